package kvsched

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	mathrand "math/rand"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	conductorv1 "kvsched/clients/go/gen/kvsched/conductor/v1"
)

// Option configures a Client (see New).
type Option func(*config) error

type config struct {
	deadline, backoff, maxBackoff time.Duration
	retries                       int
	creds                         credentials.TransportCredentials
	dial                          []grpc.DialOption
	seed                          int64
	seeded                        bool
}

// WithDeadline bounds each attempt of a call (default 2 s).
func WithDeadline(d time.Duration) Option {
	return func(c *config) error { c.deadline = d; return nil }
}

// WithRetries sets how many times a call is retried at most (default 5); a leader search
// makes at most retries+1 rounds.
func WithRetries(n int) Option {
	return func(c *config) error { c.retries = n; return nil }
}

// WithBackoff sets the backoff between retries: base doubling up to max, with jitter
// (default 50 ms up to 1 s).
func WithBackoff(base, max time.Duration) Option {
	return func(c *config) error { c.backoff, c.maxBackoff = base, max; return nil }
}

// WithSeed seeds the backoff jitter (default: the clock).
func WithSeed(seed int64) Option {
	return func(c *config) error { c.seed, c.seeded = seed, true; return nil }
}

// WithTransportCredentials dials every Conductor with creds (default: plaintext).
func WithTransportCredentials(creds credentials.TransportCredentials) Option {
	return func(c *config) error { c.creds = creds; return nil }
}

// WithTLS dials every Conductor with mutual TLS from PEM files (see TLSCredentials).
func WithTLS(caFile, certFile, keyFile string) Option {
	return func(c *config) error {
		creds, err := TLSCredentials(caFile, certFile, keyFile)
		c.creds = creds
		return err
	}
}

// WithDialOptions adds grpc dial options (interceptors, keepalive, ...) to every connection.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(c *config) error { c.dial = append(c.dial, opts...); return nil }
}

// Client talks to the leader of a set of Conductors. It is safe for concurrent use.
type Client struct {
	addresses []string
	cfg       config
	channels  *channels
	leaders   *leaderFinder

	mu      sync.Mutex
	rng     *mathrand.Rand
	renewer string // the address that renewed a lease last
}

// New is a client for the Conductors at addresses (host:port gRPC addresses of some or all
// of them; a scheme is dropped, duplicates are asked once). It connects lazily: New does not
// wait for any Conductor.
func New(addresses []string, opts ...Option) (*Client, error) {
	cfg := config{deadline: 2 * time.Second, retries: 5, backoff: 50 * time.Millisecond,
		maxBackoff: time.Second}
	for _, opt := range opts {
		if err := opt(&cfg); err != nil {
			return nil, err
		}
	}
	if cfg.deadline <= 0 || cfg.retries < 0 || cfg.backoff < 0 || cfg.maxBackoff < cfg.backoff {
		return nil, errors.New("kvsched: need deadline > 0, retries >= 0, 0 <= backoff <= max backoff")
	}
	seen := map[string]bool{}
	var unique []string
	for _, given := range addresses {
		for _, a := range strings.Split(given, ",") {
			if a = NormalizeAddress(a); a != "" && !seen[a] {
				seen[a] = true
				unique = append(unique, a)
			}
		}
	}
	if len(unique) == 0 {
		return nil, errors.New("kvsched: at least one Conductor address is needed")
	}
	if !cfg.seeded {
		cfg.seed = time.Now().UnixNano()
	}
	c := &Client{addresses: unique, cfg: cfg, channels: newChannels(cfg.creds, cfg.dial),
		rng: mathrand.New(mathrand.NewSource(cfg.seed))}
	c.leaders = newLeaderFinder(unique, c.channels, cfg.deadline, cfg.retries, c.backoffFor)
	return c, nil
}

// Close closes every connection; calls made afterwards, and calls in flight, fail with
// ErrClosed (code CANCELLED).
func (c *Client) Close() error { return c.channels.close() }

// Addresses are the Conductors' addresses, normalized, in the order given.
func (c *Client) Addresses() []string { return append([]string(nil), c.addresses...) }

// CurrentLeader is the address the client believes leads ("" when unknown).
func (c *Client) CurrentLeader() string { return c.leaders.believed() }

// Leader asks the Conductors who leads; returns the leader's gRPC address and uses it from
// now. Each address is asked in turn (GetLeader) until one leads or names the leader; the
// round repeats after a backoff while an election runs, up to the retries.
func (c *Client) Leader(ctx context.Context) (string, error) { return c.leaders.find(ctx) }

// LeaderStub is the leader's address and a stub on the client's connection to it, for
// calls the client does not wrap (the streams); fresh asks who leads first.
func (c *Client) LeaderStub(ctx context.Context, fresh bool) (string, conductorv1.ConductorServiceClient, error) {
	var address string
	var err error
	if fresh {
		address, err = c.leaders.find(ctx)
	} else {
		address, err = c.leaders.ensure(ctx)
	}
	if err != nil {
		return "", nil, err
	}
	stub, err := c.channels.stub(address)
	return address, stub, err
}

// StubAt is a stub on the client's connection to address, leader or not.
func (c *Client) StubAt(address string) (conductorv1.ConductorServiceClient, error) {
	return c.channels.stub(NormalizeAddress(address))
}

// backoffFor is the wait before retry number attempt+1: exponential with jitter, uniform in
// [cap/2, cap] where cap = min(max backoff, backoff * 2^attempt).
func (c *Client) backoffFor(attempt int) time.Duration {
	limit := c.cfg.maxBackoff
	if attempt < 32 {
		if grown := c.cfg.backoff << uint(attempt); grown < limit && grown >= c.cfg.backoff {
			limit = grown
		}
	}
	c.mu.Lock()
	jitter := c.rng.Float64()
	c.mu.Unlock()
	return limit/2 + time.Duration(jitter*float64(limit/2))
}

// rpc is one generated ConductorService method, as a method expression.
type rpc[Req, Resp any] func(conductorv1.ConductorServiceClient, context.Context, Req, ...grpc.CallOption) (Resp, error)

// callKind says where a call goes and whether it may be retried after a timeout.
type callKind struct{ write, idempotent bool }

var (
	idempotentWrite = callKind{write: true, idempotent: true}
	onceWrite       = callKind{write: true} // not retried after a timeout
	read            = callKind{idempotent: true}
)

// call makes one call with leader discovery and retries; timeout bounds each attempt.
func call[Req, Resp any](ctx context.Context, c *Client, method rpc[Req, Resp], request Req,
	kind callKind, timeout time.Duration) (Resp, error) {
	var zero Resp
	attempt := 0
	redirected := false
	for {
		var target string
		if kind.write {
			leader, err := c.leaders.ensure(ctx)
			if err != nil {
				if !errors.Is(err, ErrUnavailable) || ctx.Err() != nil {
					return zero, err
				}
				attempt++
				if attempt > c.cfg.retries {
					return zero, err
				}
				if err := sleep(ctx, c.backoffFor(attempt-1)); err != nil {
					return zero, err
				}
				continue
			}
			target = leader
		} else { // reads are answered everywhere; prefer the leader (freshest)
			target = c.leaders.readTarget()
		}
		stub, err := c.channels.stub(target)
		if err != nil {
			return zero, err
		}
		var trailers metadata.MD
		attemptCtx, cancel := context.WithTimeout(ctx, timeout)
		answer, err := method(stub, attemptCtx, request, grpc.Trailer(&trailers))
		cancel()
		if err == nil {
			return answer, nil
		}
		if ctx.Err() != nil {
			return zero, contextError(ctx)
		}
		if c.channels.isClosed() {
			return zero, closedError()
		}
		failure := fromCall(err, trailers)
		var delay time.Duration
		retry := false
		wasRedirect := redirected
		redirected = false
		named, hasLeader := failure.Trailers[LeaderTrailer]
		switch {
		case failure.Code == codes.FailedPrecondition && hasLeader:
			retry = true
			if leader := NormalizeAddress(named); leader != "" && leader != target {
				c.leaders.follow(leader)
				redirected = true
				// Straight to the named leader, unless standbys keep bouncing us around.
				if wasRedirect {
					delay = c.backoffFor(attempt)
				}
			} else { // election running (or a stale answer): look again after a while
				c.leaders.forget(target)
				delay = c.backoffFor(attempt)
			}
		case failure.Code == codes.Unavailable ||
			(failure.Code == codes.DeadlineExceeded && kind.idempotent):
			retry = true
			c.leaders.forget(target)
			delay = c.backoffFor(attempt)
		}
		if !retry {
			return zero, failure
		}
		attempt++
		if attempt > c.cfg.retries {
			failure.Message = fmt.Sprintf("gave up after %d attempts; last from %s: %s",
				attempt, target, failure.Message)
			failure.gaveUp = true
			return zero, failure
		}
		if delay > 0 {
			if err := sleep(ctx, delay); err != nil {
				return zero, err
			}
		}
	}
}

// RegisterInstance registers (or re-registers) an instance; leaseTTL 0 takes the server's
// default.
func (c *Client) RegisterInstance(ctx context.Context, spec *conductorv1.InstanceSpec,
	leaseTTL time.Duration) (*conductorv1.RegisterInstanceResponse, error) {
	request := &conductorv1.RegisterInstanceRequest{Spec: spec}
	if leaseTTL > 0 {
		request.LeaseTtl = durationpb.New(leaseTTL)
	}
	return call(ctx, c, conductorv1.ConductorServiceClient.RegisterInstance, request,
		idempotentWrite, c.cfg.deadline)
}

// KeepAlive refreshes an instance's lease at the leader; the answer says where the
// instance's KV events resume.
func (c *Client) KeepAlive(ctx context.Context, instanceID string) (*conductorv1.KeepAliveInstanceResponse, error) {
	request := &conductorv1.KeepAliveInstanceRequest{InstanceId: instanceID}
	return call(ctx, c, conductorv1.ConductorServiceClient.KeepAliveInstance, request,
		idempotentWrite, c.cfg.deadline)
}

// RenewLease refreshes an instance's lease at whichever Conductor answers first (the one
// that renewed last, the believed leader, then every address once), with no leader search:
// a standby renews the lease in etcd itself, so the lease outlives a leader change. timeout
// bounds each attempt (0: the client's deadline). ErrNotFound when the lease lapsed
// (register again), ErrUnavailable when no Conductor renewed it.
func (c *Client) RenewLease(ctx context.Context, instanceID string, timeout time.Duration) (*conductorv1.KeepAliveInstanceResponse, error) {
	if timeout <= 0 {
		timeout = c.cfg.deadline
	}
	request := &conductorv1.KeepAliveInstanceRequest{InstanceId: instanceID}
	c.mu.Lock()
	order := []string{c.renewer, c.leaders.believed()}
	c.mu.Unlock()
	order = append(order, c.addresses...)
	tried := map[string]bool{}
	last := "no Conductor answered"
	for _, address := range order {
		if address == "" || tried[address] {
			continue
		}
		tried[address] = true
		stub, err := c.channels.stub(address)
		if err != nil {
			return nil, err
		}
		attemptCtx, cancel := context.WithTimeout(ctx, timeout)
		answer, err := stub.KeepAliveInstance(attemptCtx, request)
		cancel()
		if err == nil {
			c.mu.Lock()
			c.renewer = address // asked first next time: a hung leader costs once
			c.mu.Unlock()
			return answer, nil
		}
		if ctx.Err() != nil {
			return nil, contextError(ctx)
		}
		if c.channels.isClosed() {
			return nil, closedError()
		}
		failure := fromCall(err, nil)
		if failure.Code == codes.NotFound {
			return nil, failure
		}
		if failure.Code == codes.Unavailable || failure.Code == codes.DeadlineExceeded {
			c.leaders.forget(address)
			c.mu.Lock()
			if c.renewer == address {
				c.renewer = ""
			}
			c.mu.Unlock()
		}
		last = fmt.Sprintf("%s: %s %s", address, codeName(failure.Code), failure.Message)
	}
	e := newError(codes.Unavailable, "no Conductor renewed the lease; "+last, nil)
	e.gaveUp = true
	return nil, e
}

// Deregister removes an instance at once (not retried after a timeout: a retry could see
// NOT_FOUND).
func (c *Client) Deregister(ctx context.Context, instanceID string) (*conductorv1.DeregisterInstanceResponse, error) {
	request := &conductorv1.DeregisterInstanceRequest{InstanceId: instanceID}
	return call(ctx, c, conductorv1.ConductorServiceClient.DeregisterInstance, request,
		onceWrite, c.cfg.deadline)
}

// ListInstances is every registered instance, by slot.
func (c *Client) ListInstances(ctx context.Context) ([]*conductorv1.InstanceStatus, error) {
	answer, err := call(ctx, c, conductorv1.ConductorServiceClient.ListInstances,
		&conductorv1.ListInstancesRequest{}, read, c.cfg.deadline)
	if err != nil {
		return nil, err
	}
	return answer.Instances, nil
}

// PublishEvents applies one KV event batch (not retried after a timeout: batches are
// sequenced).
func (c *Client) PublishEvents(ctx context.Context, batch *conductorv1.KvEventBatch) (*conductorv1.PublishKvEventsResponse, error) {
	request := &conductorv1.PublishKvEventsRequest{Batch: batch}
	return call(ctx, c, conductorv1.ConductorServiceClient.PublishKvEvents, request,
		onceWrite, c.cfg.deadline)
}

// Schedule places a request. An empty request.RequestId is set (in place) to a fresh random
// id, so every retry carries the same idempotency key. A refusal is ErrRejected, with its
// delay in RetryAfter(err).
func (c *Client) Schedule(ctx context.Context, request *conductorv1.ScheduleRequest) (*conductorv1.Decision, error) {
	if request.RequestId == "" {
		request.RequestId = newRequestID()
	}
	answer, err := call(ctx, c, conductorv1.ConductorServiceClient.Schedule, request,
		idempotentWrite, c.cfg.deadline)
	if err != nil {
		return nil, err
	}
	return answer.Decision, nil
}

// Finish reports that a request ended; the answer lists transfers to start now.
func (c *Client) Finish(ctx context.Context, request *conductorv1.FinishRequest) (*conductorv1.FinishResponse, error) {
	return call(ctx, c, conductorv1.ConductorServiceClient.Finish, request, idempotentWrite,
		c.cfg.deadline)
}

// ReportTransfer reports how a transfer ended (not retried after a timeout).
func (c *Client) ReportTransfer(ctx context.Context, request *conductorv1.ReportTransferRequest) (*conductorv1.ReportTransferResponse, error) {
	return call(ctx, c, conductorv1.ConductorServiceClient.ReportTransfer, request, onceWrite,
		c.cfg.deadline)
}

// AwaitTransfer waits (up to wait) for a transfer the Conductor ordered to end; status
// RUNNING when it has not. ErrNotFound for a transfer the leader does not know.
func (c *Client) AwaitTransfer(ctx context.Context, transferID string, wait time.Duration) (*conductorv1.AwaitTransferResponse, error) {
	request := &conductorv1.AwaitTransferRequest{TransferId: transferID, Timeout: durationpb.New(wait)}
	return call(ctx, c, conductorv1.ConductorServiceClient.AwaitTransfer, request,
		idempotentWrite, wait+c.cfg.deadline)
}

// GetSession is one session's binding and history.
func (c *Client) GetSession(ctx context.Context, sessionID string) (*conductorv1.Session, error) {
	answer, err := call(ctx, c, conductorv1.ConductorServiceClient.GetSession,
		&conductorv1.GetSessionRequest{SessionId: sessionID}, read, c.cfg.deadline)
	if err != nil {
		return nil, err
	}
	return answer.Session, nil
}

// GetPolicy is the placement policy in force.
func (c *Client) GetPolicy(ctx context.Context) (*conductorv1.GetPolicyResponse, error) {
	return call(ctx, c, conductorv1.ConductorServiceClient.GetPolicy,
		&conductorv1.GetPolicyRequest{}, read, c.cfg.deadline)
}

// SetPolicy changes the policy (`name` or `name:key=value,...`). A retry after a timeout
// may report PreviousSpec equal to spec.
func (c *Client) SetPolicy(ctx context.Context, spec string) (*conductorv1.SetPolicyResponse, error) {
	return call(ctx, c, conductorv1.ConductorServiceClient.SetPolicy,
		&conductorv1.SetPolicyRequest{Spec: spec}, idempotentWrite, c.cfg.deadline)
}

// Explain is every candidate's cost terms for a prompt; it changes nothing.
func (c *Client) Explain(ctx context.Context, request *conductorv1.ExplainRequest) (*conductorv1.ExplainResponse, error) {
	return call(ctx, c, conductorv1.ConductorServiceClient.Explain, request, read, c.cfg.deadline)
}

// GetLeader is GetLeader as one Conductor (the believed leader, else the next address)
// answers it.
func (c *Client) GetLeader(ctx context.Context) (*conductorv1.GetLeaderResponse, error) {
	return call(ctx, c, conductorv1.ConductorServiceClient.GetLeader,
		&conductorv1.GetLeaderRequest{}, read, c.cfg.deadline)
}

// newRequestID is 32 random hex digits (as a uuid4 hex).
func newRequestID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("kvsched: no randomness for a request id: %v", err))
	}
	return hex.EncodeToString(b[:])
}

// sleep waits d, or until ctx ends (its error then).
func sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return contextError(ctx)
	}
}

// contextError is the *Error for a caller's context that ended (CANCELLED or
// DEADLINE_EXCEEDED), wrapping the context's error.
func contextError(ctx context.Context) error {
	s := status.FromContextError(ctx.Err())
	e := newError(s.Code(), s.Message(), nil)
	e.cause = ctx.Err()
	return e
}
