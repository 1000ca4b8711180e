package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
)

// shBlocks returns the ```sh blocks of the Markdown file at path, in order.
func shBlocks(t *testing.T, path string) []string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	for _, part := range strings.Split(string(raw), "```sh\n")[1:] {
		end := strings.Index(part, "```")
		if end < 0 {
			t.Fatalf("%s: a ```sh block is not closed", path)
		}
		blocks = append(blocks, part[:end])
	}
	return blocks
}

// curlExample is one curl command of docs/api.md's example and the answer its comment
// line shows: "# 202 {...}".
type curlExample struct {
	cmd   string
	code  int
	pairs []string // the comment's "name":"value" and "name":true|false pairs
}

var (
	answerLine = regexp.MustCompile(`^# (\d{3})\b(.*)$`)
	stablePair = regexp.MustCompile(`"[a-z_]+":("[^"]*"|true|false)`)
)

// curlExamples reads the curl commands of block (with their continuation lines) and the
// "# <status> <body>" line under each.
func curlExamples(t *testing.T, block string) []curlExample {
	t.Helper()
	var out []curlExample
	lines := strings.Split(block, "\n")
	for i := 0; i < len(lines); i++ {
		if !strings.HasPrefix(lines[i], "curl ") {
			continue
		}
		cmd := lines[i]
		for strings.HasSuffix(cmd, "\\") && i+1 < len(lines) {
			i++
			cmd += "\n" + lines[i]
		}
		if i+1 >= len(lines) {
			t.Fatalf("docs/api.md: %q has no answer line under it", cmd)
		}
		m := answerLine.FindStringSubmatch(lines[i+1])
		if m == nil {
			t.Fatalf("docs/api.md: the line under %q is %q, want \"# <status> <answer>\"", cmd, lines[i+1])
		}
		code, _ := strconv.Atoi(m[1])
		out = append(out, curlExample{cmd: cmd, code: code, pairs: stablePair.FindAllString(m[2], -1)})
	}
	return out
}

// TestReadmeRunsAsPasted runs the README's "To run the reference app for real" block as a
// user pastes it into a shell (bin/idemq is the binary under test, `make` does nothing,
// and only the addresses change: the defaults and every IDEMQ_*_ADDR=:port of the block
// become free ports; the API keeps listening on all interfaces, as the default :8080
// does), on a schema and a Redis database of its own. Every process it starts must stay
// up; then docs/api.md's curl examples, run in that shell's variables, must answer what
// their comment lines say, and the dashboard's pages 200 with its user and password.
func TestReadmeRunsAsPasted(t *testing.T) {
	t.Parallel()
	for _, tool := range []string{"bash", "openssl", "curl"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("the README's steps need %s: %v", tool, err)
			}
			t.Skipf("the README's steps need %s (apt-get install %s): %v", tool, tool, err)
		}
	}
	takeStackSlot(t)
	var block string
	for _, b := range shBlocks(t, "../../README.md") {
		if strings.Contains(b, "bin/idemq migrate") {
			block = b
		}
	}
	if block == "" {
		t.Fatal("README.md has no ```sh block running bin/idemq migrate")
	}
	background := 0
	for _, line := range strings.Split(block, "\n") {
		if code, _, _ := strings.Cut(line, "#"); strings.HasSuffix(strings.TrimSpace(code), "&") {
			background++
		}
	}

	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(binary, filepath.Join(dir, "bin", "idemq")); err != nil {
		t.Fatal(err)
	}
	tasksDir, _ := filepath.Abs("../../tasks")
	if err := os.Symlink(tasksDir, filepath.Join(dir, "tasks")); err != nil {
		t.Fatal(err)
	}

	apiPort, fakepayPort, metricsPort := testenv.FreePort(t), testenv.FreePort(t), testenv.FreePort(t)
	metrics := []string{fmt.Sprintf("http://127.0.0.1:%d", metricsPort)}
	ports := map[string]int{}
	block = regexp.MustCompile(`(IDEMQ_[A-Z_]*ADDR)=:(\d+)`).ReplaceAllStringFunc(block, func(m string) string {
		name, port, _ := strings.Cut(m, "=:")
		p, ok := ports[port]
		if !ok {
			p = testenv.FreePort(t)
			ports[port] = p
			if name == "IDEMQ_METRICS_ADDR" {
				metrics = append(metrics, fmt.Sprintf("http://127.0.0.1:%d", p))
			}
		}
		return fmt.Sprintf("%s=127.0.0.1:%d", name, p)
	})

	envFile, pidFile := filepath.Join(dir, "shell.env"), filepath.Join(dir, "pids")
	script := "set -e\nmake() { :; }\n" + block +
		"\nfor v in $(compgen -v IDEMQ_); do declare -p \"$v\"; done > " + pidFile + ".env.tmp\n" +
		"jobs -p > " + pidFile + "\nmv " + pidFile + ".env.tmp " + envFile + "\nwait\n"
	log := filepath.Join(dir, "shell.log")
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sh := exec.Command("bash", "-c", script)
	sh.Dir = dir
	sh.Env = []string{
		"PATH=" + os.Getenv("PATH"), "HOME=" + dir,
		"DATABASE_URL=" + testenv.EmptyPostgresURL(t), "REDIS_URL=" + testenv.RedisURL(t),
		fmt.Sprintf("IDEMQ_HTTP_ADDR=:%d", apiPort),
		fmt.Sprintf("IDEMQ_FAKEPAY_ADDR=127.0.0.1:%d", fakepayPort),
		fmt.Sprintf("IDEMQ_FAKEPAY_URL=http://127.0.0.1:%d", fakepayPort),
		fmt.Sprintf("IDEMQ_METRICS_ADDR=127.0.0.1:%d", metricsPort),
		// Fewer Postgres connections than the defaults: the test server is shared.
		"IDEMQ_CONCURRENCY=4", "IDEMQ_API_POOL_SIZE=4",
	}
	sh.Stdout, sh.Stderr = f, f
	sh.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { sh.Wait(); close(done) }()
	t.Cleanup(func() {
		syscall.Kill(-sh.Process.Pid, syscall.SIGTERM) // the shell and every process it started
		select {
		case <-done:
		case <-time.After(40 * time.Second):
			syscall.Kill(-sh.Process.Pid, syscall.SIGKILL)
			<-done
		}
		if t.Failed() {
			b, _ := os.ReadFile(log)
			if len(b) > 6000 {
				b = b[len(b)-6000:]
			}
			t.Logf("--- the shell's output (tail) ---\n%s", b)
		}
	})

	deadline := time.Now().Add(3 * time.Minute)
	for {
		if _, err := os.Stat(envFile); err == nil {
			break
		}
		select {
		case <-done:
			t.Fatal("the README's block stopped before it started its processes")
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the README's block did not get through its commands within 3 minutes")
		}
		time.Sleep(100 * time.Millisecond)
	}
	raw, _ := os.ReadFile(pidFile)
	pids := strings.Fields(string(raw))
	if len(pids) != background || background < 4 {
		t.Fatalf("%d of the block's %d background processes run once it is through (want all, and at least fakepay, a worker, the API and a scheduler): one stopped at start", len(pids), background)
	}
	api := fmt.Sprintf("http://127.0.0.1:%d", apiPort)
	for _, u := range append(metrics, api) {
		testenv.WaitHTTP(t, u+"/readyz", 90*time.Second)
	}

	// docs/api.md's examples, in the shell's variables, against the API's port.
	examples := curlExamples(t, shBlocks(t, "../../docs/api.md")[0])
	routes := map[string]bool{}
	body := filepath.Join(dir, "answer")
	run := func(cmd string) (int, string) {
		t.Helper()
		c := exec.Command("bash", "-c", "source "+envFile+"\n"+
			`curl() { command curl -sS --max-time 30 -o "`+body+`" -w '%{http_code}' "$@"; }`+"\n"+
			strings.ReplaceAll(cmd, "localhost:8080", fmt.Sprintf("localhost:%d", apiPort)))
		c.Env = []string{"PATH=" + os.Getenv("PATH")}
		out, err := c.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmd, err, out)
		}
		code, _ := strconv.Atoi(strings.TrimSpace(string(out)))
		b, _ := os.ReadFile(body)
		return code, string(b)
	}
	for _, ex := range examples {
		if m := regexp.MustCompile(`(?:-XPOST|-X POST) localhost:8080(/v1/\S+)`).FindStringSubmatch(ex.cmd); m != nil {
			routes["POST "+m[1]] = true
		}
		if strings.Contains(ex.cmd, "localhost:8080/v1/jobs/") {
			routes["GET /v1/jobs/{key}"] = true
		}
		paths := []string{""}
		if strings.Contains(ex.cmd, "/ledger/") { // "the same way": the dashboard and the schedule page
			paths = []string{"/ledger/", "/monitoring/", "/schedule/"}
		}
		for _, p := range paths {
			cmd := ex.cmd
			if p != "" {
				cmd = strings.Replace(cmd, "/ledger/", p, 1)
			}
			// A GET's answer may show a job not yet done: ask again until it matches.
			until := time.Now().Add(60 * time.Second)
			for {
				code, got := run(cmd)
				missing := ""
				for _, pair := range ex.pairs {
					if !strings.Contains(got, pair) {
						missing = pair
					}
				}
				if code == ex.code && missing == "" {
					break
				}
				if strings.Contains(cmd, "-XPOST") || time.Now().After(until) {
					t.Fatalf("%s\nanswered %d %.500s; docs/api.md says %d with %s", cmd, code, got, ex.code, missing)
				}
				time.Sleep(250 * time.Millisecond)
			}
		}
	}
	for _, want := range []string{"POST /v1/charges", "POST /v1/wallet/debits", "POST /v1/checkouts", "GET /v1/jobs/{key}"} {
		if !routes[want] {
			t.Errorf("docs/api.md's example has no %s", want)
		}
	}

	// Every process the block started is still up.
	for _, p := range pids {
		pid, _ := strconv.Atoi(p)
		if err := syscall.Kill(pid, 0); err != nil {
			t.Errorf("process %d that the block started is gone: %v", pid, err)
		}
	}
}
