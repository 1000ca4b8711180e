package api

import (
	"bytes"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/hibiken/asynqmon"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/outbox"
)

//go:embed templates/*.html
var templateFS embed.FS

var pages = template.Must(template.New("").Funcs(template.FuncMap{
	"stamp":        stamp,
	"taskLink":     taskLink,
	"rowLink":      func(key string) string { return "/ledger/" + url.PathEscape(key) },
	"jobLink":      func(key string) string { return "/v1/jobs/" + url.PathEscape(key) },
	"scheduleLink": scheduleLink,
	"short": func(b []byte) string {
		s := string(b)
		if len(s) > 80 {
			return s[:77] + "..."
		}
		return s
	},
	"pretty": func(b []byte) string { return string(prettyJSON(b)) },
}).ParseFS(templateFS, "templates/*.html"))

// statuses are the ledger statuses the list page filters by.
// maxLedgerPageRows caps ?limit= on /ledger/ (a larger limit shows this many): the page
// reads whole rows, and a result may be up to 1 MiB.
const maxLedgerPageRows = 100

var statuses = []string{idempotency.StatusInProgress, idempotency.StatusCompleted, idempotency.StatusFailed, idempotency.StatusNeedsAttention}

type listPage struct {
	Rows     []idempotency.Record
	Intents  []outbox.IntentInfo // accepted jobs not finished yet (the outbox)
	Status   string
	Statuses []string
	Limit    int
	Max      int               // maxLedgerPageRows
	Queues   map[string]string // key → the queue its intent recorded
	Key      string
	Missing  string // Key has no ledger row
	Invalid  string // why Key cannot be a key

	Filter    listFilter
	Tasks     map[string][]taskRef // key → asynqmon's pages of its TaskIDs (keys with an intent)
	Counts    []countRow           // rows started in the window, by outcome; nil when not counted
	Events    []countRow           // events recorded in the window, by kind
	CountsErr string               // why there are no counts
	Ages      []string             // the choices of started_within and older_than
	Windows   []string             // the choices of window
	Leases    []string             // the choices of lease
}

// ledgerList serves /ledger/: the most recently started rows under the filters of its
// query (parseListFilter), with counts per outcome over a window; a ?key= search goes to
// that row's page. A bad filter is a 400 naming the parameter and what it allows.
func (s *Server) ledgerList(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := parseListFilter(q)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	p := listPage{Status: f.Status, Statuses: statuses, Limit: f.Limit, Max: maxLedgerPageRows, Key: strings.TrimSpace(q.Get(paramKey)),
		Filter: f, Ages: ageNames(ages), Windows: ageNames(windows), Leases: leases}
	if p.Key != "" {
		if err := checkPageKey(p.Key); err != nil {
			p.Invalid = invalidReason(err)
		} else if _, err := s.deps.Ledger.Get(r.Context(), p.Key); err == nil {
			http.Redirect(w, r, "/ledger/"+url.PathEscape(p.Key), http.StatusSeeOther)
			return
		} else {
			p.Missing = p.Key
		}
	}
	rows, err := s.deps.Ledger.Find(r.Context(), f.filter())
	if err != nil {
		s.internal(w, r, "read the ledger", err) // 503 while Postgres is unavailable
		return
	}
	p.Rows = rows
	window, _ := findAge(windows, f.Window)
	if c, err := s.deps.Ledger.Count(r.Context(), window.D); err != nil {
		s.log.Error("api: ledger page: counts", "err", err)
		p.CountsErr = "counts unavailable: " + err.Error()
	} else {
		p.Counts, p.Events = countRows(f, c)
	}
	if il, ok := s.deps.Enqueuer.(intentLister); ok && !f.Filtered() {
		if p.Intents, err = il.UnfinishedIntents(r.Context(), p.Limit); err != nil {
			s.log.Error("api: ledger page: outbox", "err", err)
		}
	}
	keys := make([]string, 0, len(p.Rows)+len(p.Intents))
	for _, r := range p.Rows {
		keys = append(keys, r.Key)
	}
	for _, in := range p.Intents {
		keys = append(keys, in.Key)
	}
	its, err := outbox.IntentTasks(r.Context(), s.deps.Pool, keys)
	if err != nil {
		s.log.Error("api: ledger page: intents' tasks", "err", err)
	}
	p.Queues, p.Tasks = make(map[string]string, len(its)), make(map[string][]taskRef, len(its))
	for key, it := range its {
		p.Queues[key], p.Tasks[key] = it.Queue, taskRefs(it)
	}
	s.render(w, http.StatusOK, "list.html", p)
}

// intentLister is the outbox listing the ledger page shows, when the Enqueuer offers it
// (*outbox.Client does).
type intentLister interface {
	UnfinishedIntents(ctx context.Context, limit int) ([]outbox.IntentInfo, error)
}

type rowPage struct {
	Key       string
	Row       *idempotency.Record        // nil: no worker has claimed the key yet
	Intent    *outbox.IntentInfo         // nil: not recorded through the outbox (or purged)
	TaskState string                     // asynq's state of the job's task, "" when Redis has none
	TaskLink  string                     // asynqmon's page of it, "" when Redis has none
	Queue     string                     // where the task is, else the queue its intent recorded, else ""
	Traces    []traceLink                // the job's traces, when IDEMQ_TRACE_URL_TEMPLATE is set
	Steps     []idempotency.StepRecord   // the steps of the row's current generation, in seq order
	Entry     string                     // the schedule entry whose job it is (a cron:<entry>:... key), else ""
	History   []idempotency.HistoryEvent // the key's exceptional events, oldest first, across generations
}

// traceLink is one trace a ledger row links to: ID's page in the tracing UI, and whose
// trace it is.
type traceLink struct{ ID, URL, Note string }

// traces returns the links to p's traces: the request's that accepted the job (its
// intent's) and the delivery's whose claim holds or did the work (its row's), one link
// when they are the same trace, as they are when the delivery continued the request's.
func (s *Server) traces(p *rowPage) []traceLink {
	tmpl := s.opts.TraceURLTemplate
	if tmpl == "" {
		return nil
	}
	var request, delivery string
	if p.Intent != nil {
		request = p.Intent.TraceID()
	}
	if p.Row != nil {
		delivery = p.Row.TraceID
	}
	link := func(id, note string) traceLink {
		return traceLink{ID: id, URL: strings.ReplaceAll(tmpl, "{trace_id}", id), Note: note}
	}
	switch {
	case request != "" && (delivery == "" || delivery == request):
		note := "the request that accepted it, and every delivery of the job"
		return []traceLink{link(request, note)}
	case request != "":
		return []traceLink{link(request, "the request that accepted it"), link(delivery, "the delivery whose claim holds or did the work")}
	case delivery != "":
		return []traceLink{link(delivery, "the delivery whose claim holds or did the work")}
	}
	return nil
}

// ledgerRow serves /ledger/{key}: one row with its result, recorded steps and history,
// and the asynq task of the same id when Redis still has it.
func (s *Server) ledgerRow(w http.ResponseWriter, r *http.Request) {
	key := r.PathValue("key")
	if err := checkPageKey(key); err != nil {
		s.render(w, http.StatusNotFound, "list.html", listPage{Statuses: statuses, Limit: 50, Key: key, Invalid: invalidReason(err)})
		return
	}
	p := rowPage{Key: key, Entry: scheduleEntryOf(key)}
	rec, err := s.deps.Ledger.Get(r.Context(), key)
	if err != nil && !errors.Is(err, idempotency.ErrNotFound) {
		s.internal(w, r, "read the ledger", err)
		return
	}
	p.Row = rec
	if rec != nil {
		if p.Steps, err = s.deps.Ledger.Steps(r.Context(), key); err != nil {
			s.internal(w, r, "read the job's steps", err)
			return
		}
	}
	if il, ok := s.deps.Enqueuer.(IntentLookup); ok {
		if in, err := il.Intent(r.Context(), key); err == nil {
			p.Intent = in
		}
	}
	if p.History, err = s.deps.Ledger.History(r.Context(), key); err != nil {
		s.internal(w, r, "read the job's history", err)
		return
	}
	p.Traces = s.traces(&p)
	if p.Row == nil && p.Intent == nil {
		s.render(w, http.StatusNotFound, "list.html", listPage{Statuses: statuses, Limit: 50, Key: key, Missing: key})
		return
	}
	id := key
	if p.Intent != nil {
		id = p.Intent.TaskID()
	}
	queues, err := s.intentQueues(r.Context(), []string{key})
	if err != nil {
		s.log.Error("api: ledger row page: queue", "key", key, "err", err)
	}
	p.Queue = queues[key]
	if info, err := s.findTask(p.Queue, id); err == nil {
		p.TaskState, p.TaskLink, p.Queue = info.State.String(), taskLink(info.Queue, id), info.Queue
	} else if !taskMissing(err) {
		s.log.Warn("api: ledger row page: asynq task", "key", key, "err", err)
	}
	s.render(w, http.StatusOK, "row.html", p)
}

// intentQueues returns the queue each of keys was accepted into, for the keys recorded
// through the outbox (job_intents); the others are absent from the map.
func (s *Server) intentQueues(ctx context.Context, keys []string) (map[string]string, error) {
	return outbox.IntentQueues(ctx, s.deps.Pool, keys)
}

// findTask looks for the asynq task with TaskID id: in queue first when it is not empty
// (the one its intent recorded), then in every queue Redis knows, since a job published
// without the outbox may be in any of them. The error wraps asynq.ErrTaskNotFound when no
// queue holds it.
func (s *Server) findTask(queue, id string) (*asynq.TaskInfo, error) {
	if queue != "" {
		if info, err := s.insp.GetTaskInfo(queue, id); !taskMissing(err) {
			return info, err
		}
	}
	all, err := s.insp.Queues()
	if err != nil {
		return nil, err
	}
	for _, q := range all {
		if q == queue {
			continue
		}
		if info, err := s.insp.GetTaskInfo(q, id); !taskMissing(err) {
			return info, err
		}
	}
	return nil, fmt.Errorf("%w: %q is in no queue", asynq.ErrTaskNotFound, id)
}

// taskMissing reports whether err, from Inspector.GetTaskInfo, says that the queue does
// not hold the task (or does not exist).
func taskMissing(err error) bool {
	return errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound)
}

// checkPageKey is idempotency.ValidateKey, except that it lets a '#' pass: finished rows
// from before '#' was reserved may keep theirs, and their pages still open. Bytes that
// Postgres refuses in text (a NUL, invalid UTF-8) never reach a query.
func checkPageKey(key string) error {
	return idempotency.ValidateKey(strings.ReplaceAll(key, string(idempotency.ReservedKeyByte), "-"))
}

// invalidReason is what checkPageKey's error says beyond "invalid key".
func invalidReason(err error) string {
	return strings.TrimPrefix(err.Error(), idempotency.ErrInvalidKey.Error()+": ")
}

func (s *Server) render(w http.ResponseWriter, code int, name string, data any) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	if err := pages.ExecuteTemplate(w, name, data); err != nil {
		s.log.Error("api: render "+name, "err", err)
	}
}

// taskLink is asynqmon's page of the task in queue whose TaskID is id (the first publish
// of a job uses its key as TaskID).
func taskLink(queue, id string) string {
	return "/monitoring/queues/" + url.PathEscape(queue) + "/tasks/" + url.PathEscape(id)
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// prettyResult is asynqmon's ResultFormatter: JSON results indented, anything else as is
// when printable.
func prettyResult(_ string, result []byte) string {
	return string(prettyJSON(result))
}

func prettyJSON(b []byte) []byte {
	var out bytes.Buffer
	if len(b) == 0 || json.Indent(&out, b, "", "  ") != nil {
		return []byte(asynqmon.DefaultResultFormatter.FormatResult("", b))
	}
	return out.Bytes()
}
