package kvsched_test

// Tests against live Conductors, run by tests/conductor/test_go_client.py, which starts them
// and passes where they are in the environment (each test skips without it):
//   KVSCHED_LIVE_CONDUCTORS   comma-separated gRPC addresses of two Conductors on one etcd
//   KVSCHED_LIVE_STOP_LEADER  URL that, POSTed to, stops the leading Conductor and answers
//                             its address
//   KVSCHED_LIVE_BLOCK_HASH   a block hash above 2^63, in decimal (the Python side checks
//                             that the Conductor's index holds exactly that value)
//   KVSCHED_LIVE_TLS_CONDUCTOR, KVSCHED_LIVE_TLS_CA, _CERT, _KEY: a Conductor serving
//                             mutual TLS, the CA, and an operator's certificate and key

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	commonv1 "kvsched/clients/go/gen/kvsched/common/v1"
	conductorv1 "kvsched/clients/go/gen/kvsched/conductor/v1"
	"kvsched/clients/go/kvsched"
)

const liveBlockSize = 16 // the Conductor's default block size

func liveEnv(t *testing.T, names ...string) []string {
	t.Helper()
	values := make([]string, len(names))
	for i, name := range names {
		if values[i] = os.Getenv(name); values[i] == "" {
			t.Skipf("%s is not set: run by tests/conductor/test_go_client.py against live Conductors", name)
		}
	}
	return values
}

func liveInstance(i int) *conductorv1.InstanceSpec {
	return &conductorv1.InstanceSpec{
		InstanceId: "go-node/engine-" + strconv.Itoa(i),
		Url:        "http://127.0.0.1:" + strconv.Itoa(9100+i),
		Node:       "go-node",
		Role:       commonv1.Role_ROLE_BOTH,
	}
}

// nextSequences is where each instance's KV events resume, as the leader says.
func nextSequences(ctx context.Context, t *testing.T, client *kvsched.Client) map[string]uint64 {
	t.Helper()
	instances, err := client.ListInstances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := map[string]uint64{}
	for _, status := range instances {
		next[status.Spec.InstanceId] = status.NextEventSequence
	}
	return next
}

func publish(ctx context.Context, t *testing.T, client *kvsched.Client, instanceID string, sequence uint64, event *conductorv1.KvEvent) {
	t.Helper()
	batch := &conductorv1.KvEventBatch{InstanceId: instanceID, Sequence: sequence, Events: []*conductorv1.KvEvent{event}}
	answer, err := client.PublishEvents(ctx, batch)
	if err != nil {
		t.Fatal(err)
	}
	if answer.NextSequence != sequence+1 {
		t.Fatalf("%s: next sequence %d after %d", instanceID, answer.NextSequence, sequence)
	}
}

func TestLiveConductorsRegisterScheduleFollowTheLeaderAndReject(t *testing.T) {
	env := liveEnv(t, "KVSCHED_LIVE_CONDUCTORS", "KVSCHED_LIVE_STOP_LEADER", "KVSCHED_LIVE_BLOCK_HASH")
	big, err := strconv.ParseUint(env[2], 10, 64)
	if err != nil || big < 1<<63 {
		t.Fatalf("KVSCHED_LIVE_BLOCK_HASH %q: want a decimal above 2^63", env[2])
	}
	client, err := kvsched.New(strings.Split(env[0], ","), kvsched.WithDeadline(2*time.Second),
		kvsched.WithRetries(20), kvsched.WithBackoff(20*time.Millisecond, 200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	leader, err := client.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Register two instances (leases long enough to outlive the test: nothing renews them).
	for i := 0; i < 2; i++ {
		registered, err := client.RegisterInstance(ctx, liveInstance(i), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if registered.Instance.Spec.InstanceId != liveInstance(i).InstanceId || registered.LeaseTtl.AsDuration() != time.Minute {
			t.Fatalf("registered %v", registered)
		}
	}
	// Instance 0 caches a chain whose hashes are above 2^63; a prompt over that chain is
	// placed on it with every block a hit, which only happens if the hashes arrived intact.
	hashes := []uint64{big, big ^ 0xFF}
	first := liveInstance(0).InstanceId
	publish(ctx, t, client, first, nextSequences(ctx, t, client)[first], &conductorv1.KvEvent{
		Event: &conductorv1.KvEvent_BlocksStored{BlocksStored: &conductorv1.BlocksStored{
			BlockHashes: hashes, Tier: commonv1.Tier_TIER_GPU,
		}},
	})
	// The first placement sends them packed, the second as the repeated field.
	schedule := func(id string, packed bool) (*conductorv1.Decision, error) {
		request := &conductorv1.ScheduleRequest{
			RequestId: id, PromptTokens: 2*liveBlockSize + 3, OutputTokens: 8, SessionId: "go-session",
		}
		if packed {
			request.PackedBlockHashes = kvsched.PackHashes(hashes)
		} else {
			request.BlockHashes = hashes
		}
		return client.Schedule(ctx, request)
	}
	decision, err := schedule("go-1", true)
	if err != nil {
		t.Fatal(err)
	}
	if decision.InstanceId != first || decision.CachedTokens != 2*liveBlockSize {
		t.Fatalf("placed on %s with %d cached tokens; want %s with %d", decision.InstanceId,
			decision.CachedTokens, first, 2*liveBlockSize)
	}

	// Stop the leader; the client's next call reaches the new one by itself.
	answer, err := http.Post(env[1], "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(answer.Body)
	answer.Body.Close()
	if stopped := strings.TrimSpace(string(body)); answer.StatusCode != http.StatusOK || stopped != leader {
		t.Fatalf("stopping the leader answered %d %q; the client believed %s leads", answer.StatusCode, stopped, leader)
	}
	stoppedAt := time.Now()
	decision, err = schedule("go-2", false)
	followed := time.Since(stoppedAt)
	if err != nil {
		t.Fatal(err)
	}
	now := client.CurrentLeader()
	if now == "" || now == leader {
		t.Fatalf("after the leader stopped the client believes %q leads (it was %s)", now, leader)
	}
	if decision.InstanceId != first {
		t.Fatalf("the new leader placed the session on %s, not on %s", decision.InstanceId, first)
	}
	if asked, err := client.GetLeader(ctx); err != nil || !asked.IsLeader || asked.LeaderUrl != now {
		t.Fatalf("GetLeader at %s: %v, %v", now, asked, err)
	}

	// Both instances report 10 s of queued prefill: no placement meets the 2 s objective,
	// so the leader refuses with a retry delay of about the excess.
	next := nextSequences(ctx, t, client)
	for i := 0; i < 2; i++ {
		id := liveInstance(i).InstanceId
		publish(ctx, t, client, id, next[id], &conductorv1.KvEvent{Event: &conductorv1.KvEvent_Load{Load: &commonv1.LoadReport{
			PendingPrefillTokens: 200_000, PendingPrefill: durationpb.New(10 * time.Second), Waiting: 40,
		}}})
	}
	_, err = client.Schedule(ctx, &conductorv1.ScheduleRequest{PromptTokens: 2*liveBlockSize + 3, OutputTokens: 8,
		BlockHashes: []uint64{big - 1, big - 2}})
	delay, ok := kvsched.RetryAfter(err)
	if !errors.Is(err, kvsched.ErrRejected) || !ok || delay < 7*time.Second || delay > 10*time.Second {
		t.Fatalf("got %v with retry delay %v (%v); want a rejection retrying after 7 to 10 s", err, delay, ok)
	}
	t.Logf("leader %s -> %s (the first call after the stop took %s); rejected with retry after %s",
		leader, now, followed.Round(time.Millisecond), delay)
}

func TestLiveMutualTLS(t *testing.T) {
	env := liveEnv(t, "KVSCHED_LIVE_TLS_CONDUCTOR", "KVSCHED_LIVE_TLS_CA", "KVSCHED_LIVE_TLS_CERT", "KVSCHED_LIVE_TLS_KEY")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client, err := kvsched.New([]string{env[0]}, kvsched.WithTLS(env[1], env[2], env[3]))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	asked, err := client.GetLeader(ctx)
	if err != nil || !asked.IsLeader {
		t.Fatalf("GetLeader over mutual TLS: %v, %v", asked, err)
	}
	// The operator's certificate may read the policy; Schedule is the Routers' alone.
	if policy, err := client.GetPolicy(ctx); err != nil || policy.Spec == "" {
		t.Fatalf("GetPolicy as the operator: %v, %v", policy, err)
	}
	if _, err := client.Schedule(ctx, &conductorv1.ScheduleRequest{PromptTokens: 8}); err == nil ||
		!strings.HasPrefix(err.Error(), "PERMISSION_DENIED") {
		t.Fatalf("Schedule as the operator: %v; want PERMISSION_DENIED", err)
	}
	// Without a client certificate the Conductor does not admit the connection.
	anonymous, err := kvsched.New([]string{env[0]}, kvsched.WithTLS(env[1], "", ""), kvsched.WithRetries(0))
	if err != nil {
		t.Fatal(err)
	}
	defer anonymous.Close()
	if _, err := anonymous.GetLeader(ctx); !errors.Is(err, kvsched.ErrUnavailable) {
		t.Fatalf("a client without a certificate got %v; want UNAVAILABLE", err)
	}
}
