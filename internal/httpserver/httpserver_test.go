package httpserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"testing"
	"time"
)

// serve runs Serve with opts on a free loopback port and returns its address; the
// server stops when the test ends.
func serve(t *testing.T, h http.Handler, opts Options) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrc := make(chan string, 1)
	opts.Ready = func(a net.Addr) { addrc <- a.String() }
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, "127.0.0.1:0", h, slog.New(slog.DiscardHandler), &opts) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	select {
	case a := <-addrc:
		return a
	case err := <-done:
		t.Fatalf("Serve: %v", err)
	}
	return ""
}

// readsBody answers 200 once it has the whole body, 400 when reading it fails.
var readsBody = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	if _, err := io.ReadAll(r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.Write([]byte("ok\n"))
})

// closedWithin reads conn until it ends and reports whether it did within d.
func closedWithin(conn net.Conn, d time.Duration) (bool, error) {
	conn.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, conn)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return false, nil
	}
	return true, err
}

// TestSlowBodyIsCutOff sends a body one byte every 1.5 s: the read timeout ends the
// request instead of letting the client hold the connection for as long as it likes.
func TestSlowBodyIsCutOff(t *testing.T) {
	t.Parallel()
	const readTimeout = 2 * time.Second
	addr := serve(t, readsBody, Options{ReadTimeout: readTimeout})
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
	start := time.Now()
	stop := make(chan struct{})
	go func() {
		t := time.NewTicker(1500 * time.Millisecond)
		defer t.Stop()
		for {
			if _, err := conn.Write([]byte("x")); err != nil {
				return
			}
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	defer close(stop)
	closed, err := closedWithin(conn, readTimeout+5*time.Second)
	if !closed {
		t.Fatalf("a body trickling in at a byte per 1.5 s kept the connection open for %s (read timeout %s)", time.Since(start).Round(time.Second), readTimeout)
	}
	if err != nil {
		t.Logf("connection ended with %v after %s", err, time.Since(start).Round(time.Millisecond))
	}
}

// TestIdleConnectionIsClosed keeps a connection after one request: the server closes it
// once it has been idle for IdleTimeout.
func TestIdleConnectionIsClosed(t *testing.T) {
	t.Parallel()
	const idle = time.Second
	addr := serve(t, readsBody, Options{IdleTimeout: idle})
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Close {
		t.Fatalf("first answer %d (close %v), want 200 kept alive", resp.StatusCode, resp.Close)
	}
	conn.SetReadDeadline(time.Now().Add(idle + 5*time.Second))
	if _, err := br.ReadByte(); errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("an idle keep-alive connection was still open %s after its request (idle timeout %s)", idle+5*time.Second, idle)
	} else if err != io.EOF {
		t.Logf("idle connection ended with %v", err)
	}
}

// TestWriteTimeoutCutsOffLateAnswers: an answer not written within WriteTimeout never
// reaches the client, which sees the connection end instead.
func TestWriteTimeoutCutsOffLateAnswers(t *testing.T) {
	t.Parallel()
	const write = 500 * time.Millisecond
	addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(write + time.Second)
		w.Write([]byte("late\n"))
	}), Options{WriteTimeout: write})
	resp, err := http.Get("http://" + addr + "/")
	if err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("an answer after the write timeout arrived: %d %q", resp.StatusCode, body)
	}
}

// TestDefaults: with nil Options every bound is set, the write timeout above the read
// timeout (a handler may spend up to the read timeout reading its body).
func TestDefaults(t *testing.T) {
	if DefaultIdleTimeout != 30*time.Second || DefaultMaxConns != 1024 {
		t.Fatalf("DefaultIdleTimeout %s, DefaultMaxConns %d: want 30s and 1024", DefaultIdleTimeout, DefaultMaxConns)
	}
	if DefaultWriteTimeout <= DefaultReadTimeout {
		t.Fatalf("DefaultWriteTimeout %s is not above DefaultReadTimeout %s", DefaultWriteTimeout, DefaultReadTimeout)
	}
	addr := serve(t, readsBody, Options{})
	resp, err := http.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d, want 200", resp.StatusCode)
	}
}

// echoPath answers with the request's path.
var echoPath = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	fmt.Fprintf(w, "%s\n", r.URL.Path)
})

// TestTransferEncodingClosesConnection sends a request with both Content-Length and
// Transfer-Encoding, followed on the same connection by a second request that a proxy
// framing by Content-Length would have taken as the first one's body: the server answers
// the first, closes the connection, and never answers the smuggled one. A chunked request
// alone closes too.
func TestTransferEncodingClosesConnection(t *testing.T) {
	t.Parallel()
	addr := serve(t, echoPath, Options{})
	for name, req := range map[string]string{
		"Content-Length and Transfer-Encoding": "POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n" +
			"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
		"Transfer-Encoding alone": "POST /first HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n" +
			"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(30 * time.Second)) // against a hang only
			if _, err := io.WriteString(conn, req); err != nil {
				t.Fatal(err)
			}
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || string(body) != "/first\n" {
				t.Fatalf("first answer %d %q, want 200 /first", resp.StatusCode, body)
			}
			if !resp.Close {
				t.Errorf("the answer does not close the connection")
			}
			if second, err := http.ReadResponse(br, nil); err == nil {
				body, _ := io.ReadAll(second.Body)
				t.Fatalf("the smuggled request was answered: %d %q", second.StatusCode, body)
			} else if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Logf("after the first answer: %v", err)
			}
		})
	}
	// A request framed by Content-Length alone keeps its connection.
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabcGET /second HTTP/1.1\r\nHost: x\r\n\r\n")
	br := bufio.NewReader(conn)
	for _, want := range []string{"/first\n", "/second\n"} {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(body) != want || resp.Close {
			t.Fatalf("answer %q (close %v), want %q kept alive", body, resp.Close, want)
		}
	}
}

// TestMaxConnsCapsOpenConnections: with MaxConns connections open (idle keep-alives),
// another connection is not served until one of them closes.
func TestMaxConnsCapsOpenConnections(t *testing.T) {
	t.Parallel()
	const max = 2
	addr := serve(t, echoPath, Options{MaxConns: max})
	get := func(conn net.Conn, br *bufio.Reader, path string) error {
		if _, err := fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path); err != nil {
			return err
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if string(body) != path+"\n" {
			return fmt.Errorf("answer %q, want %q", body, path)
		}
		return nil
	}
	var open []net.Conn
	for i := range max {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if err := get(conn, bufio.NewReader(conn), fmt.Sprintf("/keep-%d", i)); err != nil {
			t.Fatal(err)
		}
		open = append(open, conn)
	}
	extra, err := net.Dial("tcp", addr) // the kernel's backlog takes it
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	br := bufio.NewReader(extra)
	fmt.Fprintf(extra, "GET /extra HTTP/1.1\r\nHost: x\r\n\r\n")
	extra.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := br.Peek(1); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection %d was served while %d were open (MaxConns %d): %v", max+1, max, max, err)
	}
	open[0].Close()
	extra.SetReadDeadline(time.Now().Add(30 * time.Second)) // against a hang only
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("connection %d not served after one of the %d closed: %v", max+1, max, err)
	}
	resp.Body.Close()
}
