package api

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemq/idemq/internal/spantest"
)

// Traced POSTs accepted in one shared transaction: the transaction is a span of its own,
// idemq.accept, linked both ways with each request's server span.
func TestSharedAcceptSpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	a := newTestAPI(t, &Options{TracerProvider: tp})
	// The first rounds (one per round in flight) wait in their transactions, so that the
	// other requests queue behind them and share the next one.
	var held atomic.Int32
	a.s.holdAccept = func(context.Context) {
		if held.Add(1) <= acceptRounds {
			time.Sleep(300 * time.Millisecond)
		}
	}
	h := otelhttp.NewHandler(a.s, "request", otelhttp.WithTracerProvider(tp)) // the server names it by route
	ctx := context.Background()
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i > 0 {
				time.Sleep(50 * time.Millisecond) // after the first
			}
			req := httptest.NewRequestWithContext(ctx, "POST", "/v1/charges", strings.NewReader(chargeBody(fmt.Sprintf("o-%d", i), 100)))
			req.Host = "localhost" // the server listens on loopback without a token
			req.Header.Set("Content-Type", "application/json")
			w := httptest.NewRecorder()
			h.ServeHTTP(w, req)
			if w.Code != http.StatusAccepted {
				t.Errorf("POST %d: %d %s", i, w.Code, w.Body)
			}
		}()
	}
	wg.Wait()
	spantest.CheckShared(t, rec.Ended(), "idemq.accept", "POST /v1/charges")
}
