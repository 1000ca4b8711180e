// Package config reads each subcommand's settings from the environment with envconfig and
// checks them, so that a bad value stops the program at start with one line naming the
// variable.
package config

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/kelseyhightower/envconfig"
	"github.com/redis/go-redis/v9"
)

// Redis is the Redis connection shared by asynq and the lock.
type Redis struct {
	RedisURL     string `envconfig:"REDIS_URL" default:"redis://127.0.0.1:6379/0" desc:"Redis holding asynq's queues and the locks: redis://host:6379/0, a Sentinel master redis://sentinel:26379/0?master_name=NAME&addr=sentinel2:26379, or with IDEMQ_REDIS_CLUSTER a cluster redis://node:6379?addr=node2:6379 (rediss:// for TLS)"`
	RedisCluster bool   `envconfig:"IDEMQ_REDIS_CLUSTER" default:"false" desc:"REDIS_URL names a Redis Cluster (its nodes as addr= parameters)"`
}

// Database is the Postgres database holding the ledger.
type Database struct {
	DatabaseURL string `envconfig:"DATABASE_URL" default:"postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable" desc:"Postgres holding the ledger (postgres:// URL or key=value DSN)"`
}

// Direct is a connection to Postgres itself, for what a transaction-mode pooler cannot
// serve.
type Direct struct {
	DirectDatabaseURL string `envconfig:"IDEMQ_DIRECT_DATABASE_URL" desc:"Postgres itself, bypassing a transaction-mode pooler in DATABASE_URL, for what needs a session or must not starve: migrate, the relays' LISTEN, heartbeats; default DATABASE_URL"`
}

// Log is the log level of a command that logs little of its own. Every subcommand reads
// IDEMQ_LOG_LEVEL, so a bad value in an environment they share stops whichever runs first.
type Log struct {
	LogLevel string `envconfig:"IDEMQ_LOG_LEVEL" default:"info" desc:"debug, info, warn or error"`
}

// Migrate configures `idemq migrate`.
type Migrate struct {
	Database
	Direct
	Log
}

// Enqueue configures `idemq enqueue`.
type Enqueue struct {
	Redis
	Database
	Log
}

// Ledger configures `idemq ledger`.
type Ledger struct {
	Database
	Log
}

// Scheduler configures `idemq scheduler`.
type Scheduler struct {
	Redis
	Database
	ScheduleFile string        `envconfig:"IDEMQ_SCHEDULE_FILE" desc:"YAML file of periodic entries, upserted into schedule_entries at start (the table every replica schedules from); each entry is checked then as its ticks would be (a task type this binary serves, a payload its task accepts, max_retry 0..2147483647), or the scheduler does not start; unset, the replica schedules from the table as other replicas wrote it"`
	Retention    time.Duration `envconfig:"IDEMQ_RETENTION" default:"720h" desc:"how long completed and failed ledger rows are kept (a scheduler's catch-up windows must be shorter)"`
	MetricsAddr  string        `envconfig:"IDEMQ_METRICS_ADDR" default:":9091" desc:"address serving /metrics, /healthz and /readyz; empty disables; each process on one host needs its own (:9092, :9093, …)"`
	// UnsafeWallClock is schedule.Config.UnsafeWallClockKeys.
	UnsafeWallClock bool `envconfig:"IDEMQ_UNSAFE_SCHEDULE_WALLCLOCK" default:"false" desc:"TESTS ONLY (negative control): key each due tick by this replica's clock reading at enqueue, to the second, instead of the scheduled instant, so that replicas name one tick differently"`
	Log
}

// Schedule configures `idemq schedule`.
type Schedule struct {
	Redis
	Database
	Log
}

// Worker configures `idemq worker`.
type Worker struct {
	Redis
	Database
	Direct
	Concurrency       int           `envconfig:"IDEMQ_CONCURRENCY" default:"10" max:"10000" desc:"tasks one worker runs at once"`
	Queues            []string      `envconfig:"IDEMQ_QUEUES" default:"default" desc:"comma-separated queues to serve, each once, optionally weighted as name:weight; the worker owns them: a task of a type it does not run found there is archived, so your own types need a queue not listed here"`
	Lease             time.Duration `envconfig:"IDEMQ_LEASE" default:"30s" min:"500ms" desc:"ledger lease of a claim; heartbeats extend it every lease/3"`
	LockTTL           time.Duration `envconfig:"IDEMQ_LOCK_TTL" default:"30s" min:"500ms" desc:"TTL of the Redis lock; a watchdog refreshes it while the handler runs"`
	ShutdownTimeout   time.Duration `envconfig:"IDEMQ_SHUTDOWN_TIMEOUT" default:"30s" desc:"how long SIGTERM waits for running tasks before they are handed back"`
	MetricsAddr       string        `envconfig:"IDEMQ_METRICS_ADDR" default:":9091" desc:"address serving /metrics, /healthz and /readyz; empty disables; each process on one host needs its own (:9092, :9093, …)"`
	FakepayURL        string        `envconfig:"IDEMQ_FAKEPAY_URL" default:"http://127.0.0.1:8090" desc:"base URL of the payment provider used by payment:charge"`
	Retention         time.Duration `envconfig:"IDEMQ_RETENTION" default:"720h" desc:"how long completed and failed ledger rows are kept (a scheduler's catch-up windows must be shorter)"`
	TaskRetention     time.Duration `envconfig:"IDEMQ_TASK_RETENTION" default:"24h" min:"1s" desc:"the longest asynq Retention of the tasks this worker runs (idemq's own producers use 24h; a plain asynq.Enqueue keeps none: 1s covers it); IDEMQ_RETENTION must be at least this plus the retry horizon of IDEMQ_TASK_MAX_RETRY plus IDEMQ_BUSY_BUDGET, or the worker refuses to start; lower it only if every producer of the worker's queues keeps its tasks no longer"`
	TaskMaxRetry      int           `envconfig:"IDEMQ_TASK_MAX_RETRY" default:"10" min:"1" max:"50" desc:"the largest asynq MaxRetry of the tasks this worker runs (idemq's own producers use 10, a plain asynq.Enqueue 25; tasks that never retry count as 1); bounds IDEMQ_RETENTION from below with IDEMQ_TASK_RETENTION"`
	BusyBudget        time.Duration `envconfig:"IDEMQ_BUSY_BUDGET" default:"15m" desc:"how long a task may keep retrying as busy (its key held elsewhere) or with Postgres unavailable, from its first enqueue, before that counts as a failure; at least 2 × IDEMQ_LEASE (a shorter value is raised to it); bounds IDEMQ_RETENTION from below with IDEMQ_TASK_RETENTION"`
	MaxAge            time.Duration `envconfig:"IDEMQ_MAX_AGE" default:"24h" desc:"an in-progress row older than this needs an operator instead of re-running"`
	ReconcileGrace    time.Duration `envconfig:"IDEMQ_RECONCILE_GRACE" default:"3m" desc:"how long an accepted job may be missing from Redis before it is republished (above asynq's 60-120 s recovery)"`
	GroupCommit       bool          `envconfig:"IDEMQ_GROUP_COMMIT" default:"true" desc:"concurrent deliveries share commits (leased claims and completions in one transaction, transactional deliveries in shared transactions); false gives each its own transaction on its own goroutine"`
	DebitDriver       string        `envconfig:"IDEMQ_DEBIT_DRIVER" default:"pgx" desc:"how the example's wallet:debit handler writes its entry: pgx (server.HandleTx, a pgx.Tx) or sql (server.HandleSQLTx, a *sql.Tx over pgx's stdlib)"`
	HistoryDuplicates bool          `envconfig:"IDEMQ_HISTORY_DUPLICATES" default:"true" desc:"record each delivery answered from the ledger (a cached duplicate) in its key's history; false leaves them out (still counted in idemq_ledger_events_total), sparing a duplicate-heavy load a row per duplicate"`
	LogLevel          string        `envconfig:"IDEMQ_LOG_LEVEL" default:"info" desc:"debug, info, warn or error"`
	UnsafeNoGuards    bool          `envconfig:"IDEMQ_UNSAFE_NO_GUARDS" default:"false" desc:"DEMO AND TESTS ONLY: run handlers without the lock and the ledger, to show the duplicates they prevent"`
	UnsafeNoFencing   bool          `envconfig:"IDEMQ_UNSAFE_NO_FENCING" default:"false" desc:"TESTS ONLY (negative control): the ledger stops checking fence and owner on its writes and stops fencing itself, so a stale owner can finish what a newer one holds"`
	UnsafeFaults      string        `envconfig:"IDEMQ_UNSAFE_FAULTS" desc:"TESTS ONLY (fault suite): comma-separated point:value, e.g. after_claim:0.02,after_effect:0.02 (SIGKILL itself with that probability right after the claim or right after the effect, before the completion) debit_delay:1s (random extra debit time) and debit_error:0.2 (a debit's first delivery fails after its insert, retried)"`
}

// API configures `idemq api`.
type API struct {
	Redis
	Database
	Direct
	HTTPAddr          string        `envconfig:"IDEMQ_HTTP_ADDR" default:":8080" desc:"address of the enqueue API, the dashboard, /metrics, /healthz and /readyz"`
	HTTPMaxConns      int           `envconfig:"IDEMQ_HTTP_MAX_CONNS" default:"1024" min:"1" max:"100000" desc:"connections open at once; more wait in the listen backlog until one closes"`
	HTTPIdleTimeout   time.Duration `envconfig:"IDEMQ_HTTP_IDLE_TIMEOUT" default:"30s" min:"1s" max:"1h" desc:"how long an idle keep-alive connection stays open"`
	APIToken          string        `envconfig:"IDEMQ_API_TOKEN" desc:"bearer tokens /v1/ admits (Authorization: Bearer TOKEN), comma-separated to rotate; each 32 to 256 characters of A-Z a-z 0-9 . _ ~ + / = -; unset (or change-me), /v1/ answers 403 unless IDEMQ_HTTP_ADDR is loopback, and on loopback it serves only requests for localhost or a loopback address"`
	DashboardUser     string        `envconfig:"IDEMQ_DASHBOARD_USER" desc:"basic-auth user for /monitoring/ and /ledger/; required with IDEMQ_DASHBOARD_PASSWORD (idemq api refuses to start without it)"`
	DashboardPassword string        `envconfig:"IDEMQ_DASHBOARD_PASSWORD" desc:"basic-auth password for /monitoring/ and /ledger/; unset (or change-me), they answer 403 unless IDEMQ_HTTP_ADDR is loopback, and on loopback they serve only requests for localhost or a loopback address"`
	DashboardReadonly bool          `envconfig:"IDEMQ_DASHBOARD_READONLY" default:"true" desc:"forbid dashboard actions (run, delete, archive)"`
	ShutdownTimeout   time.Duration `envconfig:"IDEMQ_SHUTDOWN_TIMEOUT" default:"30s" desc:"how long SIGTERM waits for requests in flight"`
	KeyRetention      time.Duration `envconfig:"IDEMQ_API_KEY_RETENTION" default:"24h" desc:"how long an Idempotency-Key header is remembered (its job key dedups for longer)"`
	PurgeInterval     time.Duration `envconfig:"IDEMQ_API_PURGE_INTERVAL" default:"1h" desc:"how often the API deletes Idempotency-Key rows older than IDEMQ_API_KEY_RETENTION (also once at start)"`
	TraceURLTemplate  string        `envconfig:"IDEMQ_TRACE_URL_TEMPLATE" desc:"a trace's page in your tracing UI with {trace_id} where its id goes, e.g. http://jaeger:16686/trace/{trace_id}: the ledger page links each traced job to its trace"`
	PoolSize          int32         `envconfig:"IDEMQ_API_POOL_SIZE" default:"20" desc:"Postgres connections of the API (shared accept transactions, ledger reads, the relay); a pool_max_conns in DATABASE_URL wins"`
	LogLevel          string        `envconfig:"IDEMQ_LOG_LEVEL" default:"info" desc:"debug, info, warn or error"`
}

// Fakepay configures `idemq fakepay`.
type Fakepay struct {
	Database
	Addr      string        `envconfig:"IDEMQ_FAKEPAY_ADDR" default:":8090" desc:"address of the stand-in payment provider"`
	HonorKeys bool          `envconfig:"IDEMQ_FAKEPAY_HONOR_KEYS" default:"true" desc:"answer a repeated Idempotency-Key with the first charge, like Stripe"`
	Delay     time.Duration `envconfig:"IDEMQ_FAKEPAY_DELAY" default:"0s" min:"0s" desc:"upper bound of a random delay added to each request"`
	LogLevel  string        `envconfig:"IDEMQ_LOG_LEVEL" default:"info" desc:"debug, info, warn or error"`
}

// kindName names envconfig's type names for people.
func kindName(typeName string) string {
	switch typeName {
	case "time.Duration":
		return "duration (such as 500ms, 30s, 5m, 24h)"
	case "bool":
		return "boolean (true or false)"
	case "int", "int8", "int16", "int32", "int64", "uint", "uint8", "uint16", "uint32", "uint64":
		return "whole number"
	case "float32", "float64":
		return "number"
	}
	return typeName
}

// Load fills spec (a pointer to one of the structs above) from the environment and checks
// it. The error is one line naming the variable at fault and, for a number out of bounds,
// the bound.
//
// A number or duration follows its field's min and max tags (a bound written in the
// field's own unit: 500ms, 10000); without a min tag a count must be at least 1 and a
// duration greater than zero.
func Load(spec any) error {
	if err := envconfig.Process("", spec); err != nil {
		var pe *envconfig.ParseError
		if errors.As(err, &pe) {
			if errors.Is(pe.Err, strconv.ErrRange) && strings.HasPrefix(strings.TrimSpace(pe.Value), "-") {
				return fmt.Errorf("%s=%q: must be at least 1", pe.KeyName, pe.Value)
			}
			if errors.Is(pe.Err, strconv.ErrRange) {
				return fmt.Errorf("%s=%q: must be at most %s", pe.KeyName, pe.Value, maxOf(spec, pe.FieldName))
			}
			return fmt.Errorf("%s=%q: not a valid %s", pe.KeyName, pe.Value, kindName(pe.TypeName))
		}
		return err
	}
	return check(reflect.ValueOf(spec).Elem())
}

// maxOf is the largest value field of spec takes: its max tag, else its type's.
func maxOf(spec any, field string) string {
	f, ok := reflect.TypeOf(spec).Elem().FieldByName(field)
	if !ok {
		return "?"
	}
	if m := f.Tag.Get("max"); m != "" {
		return m
	}
	switch f.Type.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return strconv.FormatInt(int64(1)<<(f.Type.Bits()-1)-1, 10)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return strconv.FormatUint(uint64(1)<<f.Type.Bits()-1, 10)
	}
	return "?"
}

// check walks the struct and validates each field by its variable name and type.
func check(v reflect.Value) error {
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		f, fv := t.Field(i), v.Field(i)
		if f.Anonymous {
			if err := check(fv); err != nil {
				return err
			}
			continue
		}
		key := f.Tag.Get("envconfig")
		if err := checkBounds(f, fv); err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
		if err := checkField(key, fv.Interface()); err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
	}
	return nil
}

var durationType = reflect.TypeOf(time.Duration(0))

// checkBounds holds a signed number or a duration to its field's min and max tags.
func checkBounds(f reflect.StructField, v reflect.Value) error {
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
	default:
		return nil
	}
	isDuration := f.Type == durationType
	format := func(n int64) string { return strconv.FormatInt(n, 10) }
	if isDuration {
		format = func(n int64) string { return time.Duration(n).String() }
	}
	n := v.Int()
	if isDuration && n < 0 {
		return fmt.Errorf("negative duration %s", format(n))
	}
	lo, hasLo := bound(f, "min", isDuration)
	hi, hasHi := bound(f, "max", isDuration)
	switch {
	case hasLo && hasHi && (n < lo || n > hi):
		return fmt.Errorf("must be between %s and %s, got %s", format(lo), format(hi), format(n))
	case hasLo && n < lo:
		return fmt.Errorf("must be at least %s, got %s", format(lo), format(n))
	case !hasLo && isDuration && n == 0:
		return errors.New("must be greater than zero")
	case !hasLo && !isDuration && n < 1:
		return fmt.Errorf("must be at least 1, got %s", format(n))
	}
	if hasHi && n > hi {
		return fmt.Errorf("must be at most %s, got %s", format(hi), format(n))
	}
	return nil
}

// bound reads f's min or max tag. The tags are constants of this file, so one that does
// not parse is a programming error (TestBoundTagsParse).
func bound(f reflect.StructField, tag string, isDuration bool) (int64, bool) {
	s := f.Tag.Get(tag)
	if s == "" {
		return 0, false
	}
	if isDuration {
		d, err := time.ParseDuration(s)
		if err != nil {
			panic(fmt.Sprintf("config: %s tag of %s: %v", tag, f.Name, err))
		}
		return int64(d), true
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		panic(fmt.Sprintf("config: %s tag of %s: %v", tag, f.Name, err))
	}
	return n, true
}

func checkField(key string, v any) error {
	switch x := v.(type) {
	case []string:
		if len(x) == 0 {
			return errors.New("must not be empty")
		}
		for _, q := range x {
			if strings.TrimSpace(q) == "" {
				return errors.New("has an empty entry")
			}
		}
	}
	switch key {
	case "REDIS_URL":
		if err := checkRedisURL(v.(string)); err != nil {
			return RedisURLError(v.(string), err)
		}
	case "DATABASE_URL", "IDEMQ_DIRECT_DATABASE_URL":
		if v.(string) == "" && key != "DATABASE_URL" {
			return nil
		}
		if _, err := pgx.ParseConfig(v.(string)); err != nil {
			return fmt.Errorf("not a valid Postgres URL or DSN: %w", URLError(v.(string), err))
		}
	case "IDEMQ_HTTP_ADDR", "IDEMQ_FAKEPAY_ADDR":
		if v.(string) == "" {
			return errors.New("must not be empty (set but empty would listen on every interface on a random port): " +
				"give host:port, such as 127.0.0.1:8080 for this machine only or :8080 for every interface")
		}
		return checkAddr(v.(string))
	case "IDEMQ_METRICS_ADDR":
		if v.(string) != "" {
			return checkAddr(v.(string))
		}
	case "IDEMQ_QUEUES":
		_, err := QueueWeights(v.([]string))
		return err
	case "IDEMQ_FAKEPAY_URL":
		u, err := url.Parse(v.(string))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return errors.New("not an absolute http(s) URL")
		}
	case "IDEMQ_TRACE_URL_TEMPLATE":
		if t := v.(string); t != "" {
			u, err := url.Parse(strings.ReplaceAll(t, "{trace_id}", "0"))
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || !strings.Contains(t, "{trace_id}") {
				return errors.New("not an http(s) URL with {trace_id} in it")
			}
		}
	case "IDEMQ_API_TOKEN":
		return checkAPIToken(v.(string))
	case "IDEMQ_LOG_LEVEL":
		switch v.(string) {
		case "debug", "info", "warn", "error":
		default:
			return fmt.Errorf("unknown level %q (debug, info, warn, error)", v)
		}
	}
	return nil
}

// checkAddr accepts a listen address with a port: host:port, :port, [::1]:port.
func checkAddr(addr string) error {
	if _, port, err := net.SplitHostPort(addr); err != nil || port == "" {
		return fmt.Errorf("%q is not host:port (such as 127.0.0.1:8080 or :8080)", addr)
	}
	return nil
}

// QueueWeights reads IDEMQ_QUEUES ("default,critical:6,low:1") into asynq's weights,
// weight 1 when omitted. A queue listed twice is an error: its weights would not add up,
// the last would silently win.
func QueueWeights(list []string) (map[string]int, error) {
	qs := make(map[string]int, len(list))
	for _, q := range list {
		name, w, found := strings.Cut(strings.TrimSpace(q), ":")
		weight := 1
		if found {
			n, err := strconv.Atoi(w)
			if err != nil || n <= 0 {
				return nil, fmt.Errorf("queue %q: weight must be a positive whole number", q)
			}
			weight = n
		}
		if name == "" {
			return nil, fmt.Errorf("queue %q: empty name", q)
		}
		if _, dup := qs[name]; dup {
			return nil, fmt.Errorf("queue %q is listed more than once (%s): list each queue once, with its weight", name, strings.Join(list, ","))
		}
		qs[name] = weight
	}
	return qs, nil
}

// LogLevel is the IDEMQ_LOG_LEVEL that spec (one of the structs above, loaded) holds, or
// "info" when spec is nil.
func LogLevel(spec any) string {
	if spec != nil {
		if f := reflect.ValueOf(spec).Elem().FieldByName("LogLevel"); f.IsValid() {
			return f.String()
		}
	}
	return "info"
}

const usageFormat = `{{range .}}  {{usage_key .}}	{{usage_default .}}	{{usage_description .}}{{with .Tags.Get "min"}}{{if ne . "0s"}} (at least {{.}}){{end}}{{end}}{{with .Tags.Get "max"}} (at most {{.}}){{end}}
{{end}}`

// Usage writes one line per variable of spec: name, default, meaning.
func Usage(w io.Writer, spec any) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if err := envconfig.Usagef("", spec, tw, usageFormat); err != nil {
		return err
	}
	return tw.Flush()
}

// checkRedisURL parses u in the form it has: a Sentinel master (master_name=), a single
// node, or a cluster's seeds (addr=, with options only a cluster takes).
// RedisURLExample is what an error about REDIS_URL shows a valid one to look like.
const RedisURLExample = "redis://localhost:6379/0 (rediss:// for TLS, redis://:PASSWORD@host:6379/0 with a password)"

// RedisURLError is URLError for REDIS_URL, followed by an example of a valid one.
func RedisURLError(raw string, err error) error {
	return fmt.Errorf("%w; want a URL such as %s", URLError(raw, err), RedisURLExample)
}

func checkRedisURL(u string) error {
	q := url.Values{}
	if pu, err := url.Parse(u); err == nil {
		q = pu.Query()
	}
	if q.Has("master_name") {
		_, err := redis.ParseFailoverURL(u)
		return err
	}
	_, err := redis.ParseURL(u)
	if err != nil && q.Has("addr") {
		_, err = redis.ParseClusterURL(u)
	}
	return err
}
