package kvsched

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"

	conductorv1 "kvsched/clients/go/gen/kvsched/conductor/v1"
)

// leaderFinder keeps the address believed to lead (current) and finds the leader when it
// does not know it or that address failed: each address is asked (GetLeader) in turn until
// one leads or names a leader that confirms; the round is repeated after a backoff while an
// election runs, up to retries more rounds.
type leaderFinder struct {
	addresses []string
	channels  *channels
	deadline  time.Duration
	retries   int
	backoff   func(attempt int) time.Duration

	mu      sync.Mutex
	current string // "" when unknown
	next    int    // round-robin position in addresses

	discovering chan struct{} // a one-slot semaphore: one discovery for many callers
}

func newLeaderFinder(addresses []string, ch *channels, deadline time.Duration, retries int,
	backoff func(int) time.Duration) *leaderFinder {
	return &leaderFinder{
		addresses: addresses, channels: ch, deadline: deadline, retries: retries,
		backoff: backoff, discovering: make(chan struct{}, 1),
	}
}

// believed is the address believed to lead, "" when unknown.
func (l *leaderFinder) believed() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.current
}

// readTarget is where a read goes: the believed leader (the freshest answer), else the next
// address (reads are answered everywhere).
func (l *leaderFinder) readTarget() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.current != "" {
		return l.current
	}
	return l.addresses[l.next%len(l.addresses)]
}

// follow: another Conductor named address as the leader; use it from now.
func (l *leaderFinder) follow(address string) {
	l.mu.Lock()
	l.current = address
	l.mu.Unlock()
}

// forget: address failed; stop treating it as the leader and move reads elsewhere.
func (l *leaderFinder) forget(address string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.current == address {
		l.current = ""
	}
	if l.addresses[l.next%len(l.addresses)] == address {
		l.next++
	}
}

// find asks the Conductors who leads and uses the answer from now.
func (l *leaderFinder) find(ctx context.Context) (string, error) {
	if err := l.lock(ctx); err != nil {
		return "", err
	}
	defer l.unlock()
	return l.discover(ctx)
}

// ensure is the believed leader, found first when there is none.
func (l *leaderFinder) ensure(ctx context.Context) (string, error) {
	if leader := l.believed(); leader != "" {
		return leader, nil
	}
	if err := l.lock(ctx); err != nil {
		return "", err
	}
	defer l.unlock()
	if leader := l.believed(); leader != "" { // another caller found it meanwhile
		return leader, nil
	}
	return l.discover(ctx)
}

func (l *leaderFinder) lock(ctx context.Context) error {
	select {
	case l.discovering <- struct{}{}:
		return nil
	case <-ctx.Done():
		return contextError(ctx)
	}
}

func (l *leaderFinder) unlock() { <-l.discovering }

// discover asks each address in turn; a leader another Conductor names is asked too, and
// only taken once it confirms (a standby's answer may be stale).
func (l *leaderFinder) discover(ctx context.Context) (string, error) {
	last := "no answer"
	n := len(l.addresses)
	for round := 0; round <= l.retries; round++ {
		if round > 0 {
			if err := sleep(ctx, l.backoff(round-1)); err != nil {
				return "", err
			}
		}
		asked := map[string]bool{}
		for i := 0; i < n; i++ {
			l.mu.Lock()
			address := l.addresses[l.next%n]
			l.mu.Unlock()
			if !asked[address] {
				asked[address] = true
				answer, why, err := l.ask(ctx, address)
				switch {
				case err != nil:
					return "", err
				case answer == nil:
					last = why
				case answer.IsLeader:
					l.follow(address) // the address we reached beats the advertised one
					return address, nil
				default:
					named := NormalizeAddress(answer.LeaderUrl)
					shown := named
					if shown == "" {
						shown = "(election running)"
					}
					last = fmt.Sprintf("%s: not the leader; leader %s", address, shown)
					if named != "" && !asked[named] {
						asked[named] = true
						confirm, why, err := l.ask(ctx, named)
						switch {
						case err != nil:
							return "", err
						case confirm == nil:
							last = why
						case confirm.IsLeader:
							l.follow(named)
							return named, nil
						}
					}
				}
			}
			l.mu.Lock()
			l.next++
			l.mu.Unlock()
		}
	}
	e := newError(codes.Unavailable, fmt.Sprintf("no Conductor leader found at %s; last: %s",
		strings.Join(l.addresses, ", "), last), nil)
	e.gaveUp = true
	return "", e
}

// ask is GetLeader at one address: the answer, or why there was none; err only when the
// caller's context ended or the client was closed.
func (l *leaderFinder) ask(ctx context.Context, address string) (*conductorv1.GetLeaderResponse, string, error) {
	stub, err := l.channels.stub(address)
	if err != nil {
		return nil, "", err
	}
	attempt, cancel := context.WithTimeout(ctx, l.deadline)
	defer cancel()
	answer, err := stub.GetLeader(attempt, &conductorv1.GetLeaderRequest{})
	if err == nil {
		return answer, "", nil
	}
	if ctx.Err() != nil {
		return nil, "", contextError(ctx)
	}
	if l.channels.isClosed() {
		return nil, "", closedError()
	}
	failure := fromCall(err, nil)
	return nil, fmt.Sprintf("%s: %s %s", address, codeName(failure.Code), failure.Message), nil
}
