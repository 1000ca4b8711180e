package testenv

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// RunWithIdemq builds the idemq binary once (without the race detector: end-to-end tests
// run several of these processes at once on small machines; in-process tests cover
// races), sets *binary to its path, runs the tests and exits with their code. Call it from
// TestMain.
func RunWithIdemq(m *testing.M, binary *string) {
	dir, err := os.MkdirTemp("", "idemq-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	*binary = filepath.Join(dir, "idemq")
	if out, err := exec.Command("go", "build", "-o", *binary, "github.com/idemq/idemq/cmd/idemq").CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		fmt.Fprintf(os.Stderr, "build idemq: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// WaitHTTP waits until url answers 200, or fails the test after d.
func WaitHTTP(t testing.TB, url string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s did not answer 200 within %s", url, d)
}
