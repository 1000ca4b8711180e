package main

import (
	"io"

	"github.com/idemq/idemq/internal/config"
)

func loadConfig(spec any) error               { return config.Load(spec) }
func usageConfig(w io.Writer, spec any) error { return config.Usage(w, spec) }
