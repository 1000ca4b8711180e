package main

import (
	"context"
	"io"

	"github.com/idemq/idemq/internal/bench"
	"github.com/idemq/idemq/internal/config"
)

// benchConfig is what `idemq bench` reads from the environment.
type benchConfig struct {
	config.Redis
	config.Database
	config.Log
}

func benchCommand() command {
	return command{
		name:  "bench",
		usage: "bench [-reps 3] [-seconds 2] [-concurrency 50] [-workloads noop,debit,charge[,scale,io]] [-n N] [-json PATH] [-svg PATH] [-write-docs] | bench -memory [-memory-tasks 100000] [-memory-configs A,E,F] [-memprofile DIR]",
		summary: "measure bare asynq against + lock, + ledger (leased, transactional) and the full stack, interleaved, with ratios " +
			"(defaults take ~2 min; a full run, ~20–30 min: -seconds 15 -workloads noop,debit,charge,scale,io; `idemq bench -flags` lists the flags); " +
			"-memory instead runs each configuration's server in a process of its own and reports its RSS over 100,000 tasks",
		spec: func() any { return &benchConfig{} },
		run: func(ctx context.Context, spec any, args []string, stdout, stderr io.Writer) error {
			c := spec.(*benchConfig)
			return bench.Main(ctx, c.RedisURL, c.DatabaseURL, args, stdout, stderr)
		},
	}
}
