// Command composecheck loads compose.yaml the way Docker Compose v2 does (compose-go, its
// loader, with the Compose Specification's JSON schema) and fails on anything Compose
// would refuse. .ci/run uses it where `docker compose` itself is not installed.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	path := "compose.yaml"
	if len(os.Args) > 1 {
		path = os.Args[1]
	}
	if err := check(path); err != nil {
		fmt.Fprintln(os.Stderr, "composecheck:", err)
		os.Exit(1)
	}
}

func check(path string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return err
	}
	// The variables compose.yaml requires (${VAR:?…}) get stand-ins, as a user's shell
	// would give them.
	env := []string{"IDEMQ_API_TOKEN=" + fmt.Sprintf("%064d", 0)}
	opts, err := cli.NewProjectOptions([]string{abs},
		cli.WithWorkingDirectory(filepath.Dir(abs)), cli.WithEnv(env), cli.WithOsEnv, cli.WithName("idemq"))
	if err != nil {
		return err
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		return err
	}
	fmt.Printf("%s: valid for Compose v2: project %q, services %v\n", path, project.Name, project.ServiceNames())
	return nil
}
