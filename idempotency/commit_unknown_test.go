package idempotency_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// cutProxy relays Postgres connections to upstream. Once armed, the first Sync a client
// sends after a Flush (the message that commits a finish round's implicit transaction,
// whose answers were read first; a statement's preparation ends with a Sync of its own,
// without a Flush) reaches the server,
// and then every connection is closed without its answer and new ones are refused: a
// COMMIT whose answer is lost, with no way left to ask what became of it.
type cutProxy struct {
	ln       net.Listener
	upstream string

	mu    sync.Mutex
	armed bool
	cut   bool
	conns []net.Conn
}

func startCutProxy(t *testing.T, upstream string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, upstream: upstream}
	t.Cleanup(func() { ln.Close(); p.cutAll(nil) })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p
}

func (p *cutProxy) arm() { p.mu.Lock(); p.armed = true; p.mu.Unlock() }

// cutAll closes every connection but keep and refuses new ones.
func (p *cutProxy) cutAll(keep net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for _, c := range p.conns {
		if c != keep {
			c.Close()
		}
	}
}

func (p *cutProxy) serve(client net.Conn) {
	p.mu.Lock()
	if p.cut {
		p.mu.Unlock()
		client.Close()
		return
	}
	server, err := net.Dial("tcp", p.upstream)
	if err != nil {
		p.mu.Unlock()
		client.Close()
		return
	}
	p.conns = append(p.conns, client, server)
	p.mu.Unlock()
	go io.Copy(client, server)
	// Client to server, message by message: the startup message has no type byte.
	var length [4]byte
	if _, err := io.ReadFull(client, length[:]); err != nil {
		return
	}
	body := make([]byte, binary.BigEndian.Uint32(length[:])-4)
	if _, err := io.ReadFull(client, body); err != nil {
		return
	}
	server.Write(append(length[:], body...))
	flushed := false // a Flush since the last Sync: that Sync commits a finish round
	for {
		var head [5]byte
		if _, err := io.ReadFull(client, head[:]); err != nil {
			return
		}
		body := make([]byte, binary.BigEndian.Uint32(head[1:])-4)
		if _, err := io.ReadFull(client, body); err != nil {
			return
		}
		if _, err := server.Write(append(head[:], body...)); err != nil {
			return
		}
		p.mu.Lock()
		armed := p.armed
		p.mu.Unlock()
		commit := head[0] == 'S' && flushed
		flushed = head[0] == 'H' || flushed && head[0] != 'S'
		if armed && commit {
			p.cutAll(server)                   // its answer goes nowhere; no connection is left
			time.Sleep(200 * time.Millisecond) // while the server reads the Sync
			server.Close()
			return
		}
	}
}

// A completion whose COMMIT lost its answer, when no connection can learn its outcome
// within the write timeout, returns ErrCommitUnknown and is counted as commit_unknown
// (the alert IdemqCommitInDoubt watches it).
func TestCommitUnknownIsObserved(t *testing.T) {
	t.Parallel()
	dsn := testenv.PostgresURL(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	proxy := startCutProxy(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	ctx := testenv.Context(t, time.Minute)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ev := &events{}
	l := idempotency.New(pool, &idempotency.Config{Lease: 30 * time.Second, WriteTimeout: 2 * time.Second, Observe: ev.observe})
	t.Cleanup(l.Close)

	_, err = l.Do(ctx, req("unknown-1"), func(ctx context.Context) (json.RawMessage, error) {
		proxy.arm()
		return json.RawMessage(`{"ok":true}`), nil
	})
	if !errors.Is(err, idempotency.ErrCommitUnknown) {
		t.Fatalf("Do with its commit's answer lost and Postgres out of reach: %v, want ErrCommitUnknown", err)
	}
	if got := ev.get(idempotency.EventCommitUnknown); got != 1 {
		t.Errorf("commit_unknown observed %d times, want 1", got)
	}
	if got := ev.get(idempotency.EventCommitResolved); got != 0 {
		t.Errorf("commit_resolved observed %d times, want 0", got)
	}
}
