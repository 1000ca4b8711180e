package localserver

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// PgBouncer is a private PgBouncer in front of a Postgres server, on a free loopback port.
// Stop sends SIGTERM (immediate shutdown: clients are disconnected).
type PgBouncer struct {
	Server
	// URL connects through the pooler as the backend URL's user to its database, with
	// sslmode=disable. In transaction mode add default_query_exec_mode=simple_protocol or
	// cache_describe: named prepared statements do not survive a change of server
	// connection.
	URL string

	admin string
}

// StartPgBouncer starts pgbouncer (from PATH or /usr/sbin) with pool_mode poolMode
// ("session", "transaction" or "statement") in front of the Postgres server at backend, a
// postgres:// URL whose host, port, user and password it uses (the server is only read
// from, never configured). Each database has at most poolSize server connections
// (default_pool_size and max_db_connections), shared by up to 1000 clients. Clients are
// trusted; the pooler logs in to the server with the URL's password. When run as root,
// pgbouncer runs as the postgres user (it refuses root). It returns once a query passes
// through it.
//
// Startup parameters other than application_name, client_encoding, DateStyle, TimeZone,
// standard_conforming_strings and extra_float_digits (ignored) are refused: PgBouncer 1.18
// cannot carry search_path to the server, so a URL that sets it fails to connect rather
// than working in the wrong schema.
func StartPgBouncer(backend, poolMode string, poolSize int) (*PgBouncer, error) {
	u, err := url.Parse(backend)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, fmt.Errorf("the backend must be given as a postgres:// URL, got %s", Redact(backend))
	}
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if bin, err = exec.LookPath("/usr/sbin/pgbouncer"); err != nil {
			return nil, errors.New("pgbouncer not found on PATH or in /usr/sbin (apt-get install -y pgbouncer)")
		}
	}
	cred, err := serviceUser("postgres")
	if err != nil {
		return nil, err
	}
	dir, err := ownedTempDir("idemq-pgbouncer-", cred)
	if err != nil {
		return nil, err
	}
	port, err := FreePort()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}

	host, backendPort := u.Hostname(), u.Port()
	if backendPort == "" {
		backendPort = "5432"
	}
	user := u.User.Username()
	if user == "" {
		user = "postgres"
	}
	password, _ := u.User.Password()
	database := strings.TrimPrefix(u.Path, "/")
	if database == "" {
		database = "postgres"
	}
	users := filepath.Join(dir, "users.txt")
	ini := filepath.Join(dir, "pgbouncer.ini")
	// server_login_retry: a backend that was down is tried again after 1 s, not 15.
	text := fmt.Sprintf(`[databases]
* = host=%s port=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
admin_users = %s
pool_mode = %s
default_pool_size = %d
max_db_connections = %d
max_client_conn = 1000
ignore_startup_parameters = extra_float_digits
server_login_retry = 1
`, host, backendPort, port, users, user, poolMode, poolSize, poolSize)
	for path, text := range map[string]string{users: fmt.Sprintf("%s %s\n", quoteUserlist(user), quoteUserlist(password)), ini: text} {
		if err := writeFileAs(path, text, cred); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}

	client := url.URL{Scheme: "postgres", User: url.User(user), Host: fmt.Sprintf("127.0.0.1:%d", port), Path: "/" + database, RawQuery: "sslmode=disable"}
	admin := client
	admin.Path = "/pgbouncer"
	b := &PgBouncer{URL: client.String(), admin: admin.String()}
	b.port, b.dir, b.stopSignal = port, dir, syscall.SIGTERM
	b.p = &process{name: "private pgbouncer", dir: dir, log: filepath.Join(dir, "pgbouncer.log"), cred: cred, argv: []string{bin, ini}}
	b.ready = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, b.URL+"&default_query_exec_mode=simple_protocol")
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, "SELECT 1")
		return err
	}
	return b, b.startOrClose()
}

// PoolStats is a database's line of the pooler's SHOW POOLS, summed over its users.
type PoolStats struct {
	// ClientActive counts clients linked to a server connection or idle (cl_active).
	ClientActive int
	// ClientWaiting counts clients that sent a query and wait for a server connection
	// (cl_waiting).
	ClientWaiting int
	// ServerActive counts server connections linked to a client (sv_active).
	ServerActive int
	// ServerIdle counts server connections ready for a client (sv_idle).
	ServerIdle int
}

// Pool reads SHOW POOLS on the admin console for database. A database no client has used
// yet has no pool: its PoolStats are zero.
func (b *PgBouncer) Pool(ctx context.Context, database string) (PoolStats, error) {
	conn, err := pgconn.Connect(ctx, b.admin)
	if err != nil {
		return PoolStats{}, fmt.Errorf("pgbouncer admin console: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	results, err := conn.Exec(ctx, "SHOW POOLS").ReadAll()
	if err != nil {
		return PoolStats{}, fmt.Errorf("SHOW POOLS: %w", err)
	}
	var st PoolStats
	fields := map[string]*int{"cl_active": &st.ClientActive, "cl_waiting": &st.ClientWaiting, "sv_active": &st.ServerActive, "sv_idle": &st.ServerIdle}
	for _, r := range results {
		for _, row := range r.Rows {
			if string(row[0]) != database { // the first column is the database
				continue
			}
			for i, fd := range r.FieldDescriptions {
				if p := fields[fd.Name]; p != nil {
					n, err := strconv.Atoi(string(row[i]))
					if err != nil {
						return PoolStats{}, fmt.Errorf("SHOW POOLS: %s: %w", fd.Name, err)
					}
					*p += n
				}
			}
		}
	}
	return st, nil
}

// quoteUserlist quotes s for a PgBouncer auth_file.
func quoteUserlist(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// writeFileAs writes a file that only the server user (cred, or ourselves) can read.
func writeFileAs(path, text string, cred *syscall.Credential) error {
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		return err
	}
	if cred != nil {
		return os.Chown(path, int(cred.Uid), int(cred.Gid))
	}
	return nil
}
