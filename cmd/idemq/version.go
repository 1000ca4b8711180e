package main

import (
	"context"
	"fmt"
	"io"

	"github.com/idemq/idemq/internal/release"
)

func versionCommand() command {
	return command{
		name:    "version",
		usage:   "version",
		summary: "print this binary's version, commit, schema version (its highest core migration) and Go version",
		run: func(_ context.Context, _ any, args []string, stdout, _ io.Writer) error {
			if len(args) > 0 {
				return fmt.Errorf("version: unexpected arguments %q", args)
			}
			b := release.Current()
			commit := b.Revision()
			if commit == "" {
				commit = "unknown (built without version control information)"
			}
			_, err := fmt.Fprintf(stdout, "version  %s\ncommit   %s\nschema   %d\ngo       %s\n", b.Version, commit, b.Schema, b.GoVersion)
			return err
		},
	}
}
