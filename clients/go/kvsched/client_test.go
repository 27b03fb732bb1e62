package kvsched_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	commonv1 "kvsched/clients/go/gen/kvsched/common/v1"
	conductorv1 "kvsched/clients/go/gen/kvsched/conductor/v1"
	"kvsched/clients/go/kvsched"
)

// fakeConductor answers GetLeader, Schedule and PublishKvEvents with its handlers (each
// given the call's context and its number, from 1), on a loopback port, and counts calls.
type fakeConductor struct {
	conductorv1.UnimplementedConductorServiceServer
	address  string
	leader   func(n int) *conductorv1.GetLeaderResponse
	schedule func(ctx context.Context, n int, r *conductorv1.ScheduleRequest) (*conductorv1.ScheduleResponse, error)
	publish  func(ctx context.Context, n int) error

	mu         sync.Mutex
	calls      map[string]int
	requestIDs []string
}

func (f *fakeConductor) count(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[method]++
	return f.calls[method]
}

func (f *fakeConductor) called(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[method]
}

func (f *fakeConductor) GetLeader(context.Context, *conductorv1.GetLeaderRequest) (*conductorv1.GetLeaderResponse, error) {
	return f.leader(f.count("GetLeader")), nil
}

func (f *fakeConductor) Schedule(ctx context.Context, r *conductorv1.ScheduleRequest) (*conductorv1.ScheduleResponse, error) {
	n := f.count("Schedule")
	f.mu.Lock()
	f.requestIDs = append(f.requestIDs, r.RequestId)
	f.mu.Unlock()
	return f.schedule(ctx, n, r)
}

func (f *fakeConductor) PublishKvEvents(ctx context.Context, _ *conductorv1.PublishKvEventsRequest) (*conductorv1.PublishKvEventsResponse, error) {
	if err := f.publish(ctx, f.count("PublishKvEvents")); err != nil {
		return nil, err
	}
	return &conductorv1.PublishKvEventsResponse{NextSequence: 1}, nil
}

// serve starts f on a loopback port until the test ends.
func serve(t *testing.T, f *fakeConductor) *fakeConductor {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.address = listener.Addr().String()
	f.calls = map[string]int{}
	server := grpc.NewServer()
	conductorv1.RegisterConductorServiceServer(server, f)
	go func() { _ = server.Serve(listener) }()
	t.Cleanup(server.Stop)
	return f
}

// leading answers GetLeader as the leader (or a standby that wrongly believes it leads).
func leading(int) *conductorv1.GetLeaderResponse {
	return &conductorv1.GetLeaderResponse{IsLeader: true}
}

// refuse answers FAILED_PRECONDITION naming leader in the kvsched-leader trailer, as a
// standby does ("" while an election runs).
func refuse(ctx context.Context, leader string) error {
	if err := grpc.SetTrailer(ctx, metadata.Pairs(kvsched.LeaderTrailer, leader)); err != nil {
		return err
	}
	return status.Error(codes.FailedPrecondition, "not the leader")
}

// place places every request on "i-1", its block hashes sent back in a transfer plan.
func place(_ context.Context, _ int, r *conductorv1.ScheduleRequest) (*conductorv1.ScheduleResponse, error) {
	return &conductorv1.ScheduleResponse{Decision: &conductorv1.Decision{
		RequestId:  r.RequestId,
		InstanceId: "i-1",
		Transfers:  []*commonv1.TransferPlan{{BlockHashes: r.BlockHashes}},
	}}, nil
}

func newClient(t *testing.T, addresses []string, opts ...kvsched.Option) *kvsched.Client {
	t.Helper()
	base := []kvsched.Option{
		kvsched.WithDeadline(time.Second),
		kvsched.WithBackoff(time.Millisecond, 10*time.Millisecond),
		kvsched.WithSeed(1),
	}
	client, err := kvsched.New(addresses, append(base, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestAStandbysRefusalSendsTheWriteToTheLeaderItNames(t *testing.T) {
	leader := serve(t, &fakeConductor{leader: leading, schedule: place})
	// The standby's GetLeader wrongly says it leads: only its refusal's trailer tells.
	standby := serve(t, &fakeConductor{
		leader: leading,
		schedule: func(ctx context.Context, _ int, _ *conductorv1.ScheduleRequest) (*conductorv1.ScheduleResponse, error) {
			return nil, refuse(ctx, "grpc://"+leader.address+"/")
		},
	})
	client := newClient(t, []string{standby.address, leader.address})
	big := uint64(1)<<63 + 12345 // above 2^63: must arrive and come back unchanged
	request := &conductorv1.ScheduleRequest{PromptTokens: 40, BlockHashes: []uint64{big, ^uint64(0)}}
	decision, err := client.Schedule(testContext(t), request)
	if err != nil {
		t.Fatal(err)
	}
	if decision.InstanceId != "i-1" || client.CurrentLeader() != leader.address {
		t.Fatalf("placed on %q, leader %q; want i-1 and %s", decision.InstanceId, client.CurrentLeader(), leader.address)
	}
	if standby.called("Schedule") != 1 || leader.called("Schedule") != 1 {
		t.Fatalf("Schedule calls: standby %d, leader %d; want 1 and 1", standby.called("Schedule"), leader.called("Schedule"))
	}
	if len(request.RequestId) != 32 || standby.requestIDs[0] != request.RequestId || leader.requestIDs[0] != request.RequestId {
		t.Fatalf("request ids %q, %q, %q: one fresh id for both attempts", request.RequestId, standby.requestIDs, leader.requestIDs)
	}
	echoed := decision.Transfers[0].BlockHashes
	if len(echoed) != 2 || echoed[0] != big || echoed[1] != ^uint64(0) {
		t.Fatalf("block hashes came back as %v", echoed)
	}
}

func TestAnElectionMakesTheClientLookForTheLeaderAgain(t *testing.T) {
	leader := serve(t, &fakeConductor{leader: leading, schedule: place})
	standby := serve(t, &fakeConductor{
		// First a stale "I lead", then it names the new leader.
		leader: func(n int) *conductorv1.GetLeaderResponse {
			if n == 1 {
				return &conductorv1.GetLeaderResponse{IsLeader: true}
			}
			return &conductorv1.GetLeaderResponse{LeaderUrl: leader.address}
		},
		schedule: func(ctx context.Context, _ int, _ *conductorv1.ScheduleRequest) (*conductorv1.ScheduleResponse, error) {
			return nil, refuse(ctx, "") // an election is running
		},
	})
	client := newClient(t, []string{standby.address})
	if _, err := client.Schedule(testContext(t), &conductorv1.ScheduleRequest{PromptTokens: 8}); err != nil {
		t.Fatal(err)
	}
	if client.CurrentLeader() != leader.address || leader.called("Schedule") != 1 || standby.called("GetLeader") != 2 {
		t.Fatalf("leader %q, leader Schedule calls %d, standby GetLeader calls %d",
			client.CurrentLeader(), leader.called("Schedule"), standby.called("GetLeader"))
	}
}

func TestARejectionCarriesItsRetryDelayAndIsNotRetried(t *testing.T) {
	conductor := serve(t, &fakeConductor{
		leader: leading,
		schedule: func(ctx context.Context, _ int, _ *conductorv1.ScheduleRequest) (*conductorv1.ScheduleResponse, error) {
			if err := grpc.SetTrailer(ctx, metadata.Pairs(kvsched.RetryAfterTrailer, "1500")); err != nil {
				return nil, err
			}
			return nil, status.Error(codes.ResourceExhausted, "no instance meets the TTFT SLO")
		},
	})
	client := newClient(t, []string{conductor.address})
	_, err := client.Schedule(testContext(t), &conductorv1.ScheduleRequest{PromptTokens: 8})
	delay, ok := kvsched.RetryAfter(err)
	if !errors.Is(err, kvsched.ErrRejected) || errors.Is(err, kvsched.ErrUnavailable) || !ok || delay != 1500*time.Millisecond {
		t.Fatalf("got %v, retry after %v (%v); want a rejection with 1.5 s", err, delay, ok)
	}
	if status.Code(err) != codes.ResourceExhausted || !strings.HasPrefix(err.Error(), "RESOURCE_EXHAUSTED: ") {
		t.Fatalf("status %v, message %q", status.Code(err), err.Error())
	}
	if conductor.called("Schedule") != 1 {
		t.Fatalf("a rejection was retried: %d calls", conductor.called("Schedule"))
	}
}

func TestATimeoutIsRetriedOnlyForIdempotentCalls(t *testing.T) {
	// Answer only once the attempt's deadline passed (DEADLINE_EXCEEDED, as the client sees it).
	hang := func(ctx context.Context) error { <-ctx.Done(); return status.FromContextError(ctx.Err()).Err() }
	conductor := serve(t, &fakeConductor{
		leader: leading,
		schedule: func(ctx context.Context, _ int, _ *conductorv1.ScheduleRequest) (*conductorv1.ScheduleResponse, error) {
			return nil, hang(ctx)
		},
		publish: func(ctx context.Context, _ int) error { return hang(ctx) },
	})
	client := newClient(t, []string{conductor.address}, kvsched.WithDeadline(50*time.Millisecond), kvsched.WithRetries(2))
	ctx := testContext(t)
	if _, err := client.PublishEvents(ctx, &conductorv1.KvEventBatch{InstanceId: "i-1"}); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("publish: %v", err)
	}
	if _, err := client.Schedule(ctx, &conductorv1.ScheduleRequest{PromptTokens: 8}); !errors.Is(err, kvsched.ErrUnavailable) ||
		!strings.Contains(err.Error(), "gave up after 3 attempts") {
		t.Fatalf("schedule: %v", err)
	}
	if conductor.called("PublishKvEvents") != 1 || conductor.called("Schedule") != 3 {
		t.Fatalf("attempts: publish %d (want 1), schedule %d (want 3)",
			conductor.called("PublishKvEvents"), conductor.called("Schedule"))
	}
}

func TestNoConductorIsUnavailableAfterTheRetries(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	address := listener.Addr().String()
	listener.Close() // nothing listens there now
	client := newClient(t, []string{address}, kvsched.WithRetries(1))
	_, err = client.Schedule(testContext(t), &conductorv1.ScheduleRequest{PromptTokens: 8})
	if !errors.Is(err, kvsched.ErrUnavailable) || !strings.Contains(err.Error(), "no Conductor leader found at "+address) {
		t.Fatalf("got %v", err)
	}
}

func TestTheCallersContextEndsTheRetries(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	address := listener.Addr().String()
	listener.Close() // nothing listens: the client would retry for a long while
	client := newClient(t, []string{address}, kvsched.WithRetries(1000), kvsched.WithBackoff(5*time.Millisecond, 5*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = client.Schedule(ctx, &conductorv1.ScheduleRequest{PromptTokens: 8})
	if !errors.Is(err, context.DeadlineExceeded) || status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("got %v; want the context's deadline", err)
	}
}

func TestAClosedClientFailsCallsAsClosed(t *testing.T) {
	conductor := serve(t, &fakeConductor{leader: leading, schedule: place})
	client := newClient(t, []string{conductor.address})
	if err := client.Close(); err != nil {
		t.Fatal(err)
	}
	_, err := client.Schedule(testContext(t), &conductorv1.ScheduleRequest{PromptTokens: 8})
	if !errors.Is(err, kvsched.ErrClosed) || status.Code(err) != codes.Canceled {
		t.Fatalf("got %v", err)
	}
}

func TestAddressesAndOptionsAreChecked(t *testing.T) {
	for given, want := range map[string]string{
		" grpc://10.0.0.1:50051/ ": "10.0.0.1:50051",
		"https://conductor:443":    "conductor:443",
		"127.0.0.1:1":              "127.0.0.1:1",
	} {
		if got := kvsched.NormalizeAddress(given); got != want {
			t.Errorf("NormalizeAddress(%q) = %q, want %q", given, got, want)
		}
	}
	client := newClient(t, []string{"a:1,grpc://a:1", "b:2"})
	if got := strings.Join(client.Addresses(), " "); got != "a:1 b:2" {
		t.Errorf("addresses %q", got)
	}
	bad := map[string][]kvsched.Option{
		"no deadline":      {kvsched.WithDeadline(0)},
		"negative retries": {kvsched.WithRetries(-1)},
		"backoff over max": {kvsched.WithBackoff(time.Second, time.Millisecond)},
		"cert without key": {kvsched.WithTLS("ca.pem", "cert.pem", "")},
		"missing CA":       {kvsched.WithTLS(filepath.Join(t.TempDir(), "absent.pem"), "", "")},
	}
	for name, opts := range bad {
		if _, err := kvsched.New([]string{"a:1"}, opts...); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := kvsched.New([]string{" , "}); err == nil {
		t.Error("no address: accepted")
	}
	notPEM := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := kvsched.TLSCredentials(notPEM, "", ""); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Errorf("a CA file without a certificate: %v", err)
	}
}

func TestConcurrentCallsShareOneLeaderSearch(t *testing.T) {
	conductor := serve(t, &fakeConductor{leader: leading, schedule: place})
	client := newClient(t, []string{conductor.address})
	ctx := testContext(t)
	const callers = 32
	errs := make(chan error, callers)
	var start sync.WaitGroup
	start.Add(1)
	for i := 0; i < callers; i++ {
		go func() {
			start.Wait()
			_, err := client.Schedule(ctx, &conductorv1.ScheduleRequest{PromptTokens: 8})
			errs <- err
		}()
	}
	start.Done()
	for i := 0; i < callers; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if conductor.called("GetLeader") != 1 || conductor.called("Schedule") != callers {
		t.Fatalf("GetLeader %d times (want 1), Schedule %d (want %d)",
			conductor.called("GetLeader"), conductor.called("Schedule"), callers)
	}
	ids := map[string]bool{}
	for _, id := range conductor.requestIDs {
		ids[id] = true
	}
	if len(ids) != callers {
		t.Fatalf("%d distinct request ids for %d requests", len(ids), callers)
	}
}
