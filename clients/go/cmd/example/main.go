// Command example registers an instance, places one request on it (a block hash above 2^63
// included), lists the instances, then cleans up:
//
//	example -conductor 127.0.0.1:50051 [-conductor host:port ...] [-tls-ca ca.pem -tls-cert c.pem -tls-key c.key]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	commonv1 "kvsched/clients/go/gen/kvsched/common/v1"
	conductorv1 "kvsched/clients/go/gen/kvsched/conductor/v1"
	"kvsched/clients/go/kvsched"
)

type addressList []string

func (a *addressList) String() string { return strings.Join(*a, ",") }
func (a *addressList) Set(value string) error {
	*a = append(*a, value)
	return nil
}

func main() {
	var conductors addressList
	flag.Var(&conductors, "conductor", "Conductor gRPC address host:port (repeat, or comma-separate, "+
		"for several); default $KVSCHED_CONDUCTOR or 127.0.0.1:50051")
	keep := flag.Bool("keep", false, "leave the instance registered")
	ca := flag.String("tls-ca", "", "CA certificate (PEM) the Conductors' certificates chain to; empty: plaintext")
	cert := flag.String("tls-cert", "", "this client's certificate (PEM), with -tls-key")
	key := flag.String("tls-key", "", "this client's private key (PEM)")
	flag.Parse()
	if len(conductors) == 0 {
		address := os.Getenv("KVSCHED_CONDUCTOR")
		if address == "" {
			address = "127.0.0.1:50051"
		}
		conductors = addressList{address}
	}
	opts := []kvsched.Option{}
	if *ca != "" {
		opts = append(opts, kvsched.WithTLS(*ca, *cert, *key))
	}
	if err := run(conductors, *keep, opts); err != nil {
		fmt.Fprintln(os.Stderr, "example failed:", err)
		os.Exit(1)
	}
}

func run(addresses []string, keep bool, opts []kvsched.Option) error {
	client, err := kvsched.New(addresses, opts...)
	if err != nil {
		return err
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	leader, err := client.Leader(ctx)
	if err != nil {
		return err
	}
	fmt.Println("leader:", leader)
	instanceID := fmt.Sprintf("example/engine-%d", os.Getpid())
	registered, err := client.RegisterInstance(ctx, &conductorv1.InstanceSpec{
		InstanceId: instanceID,
		Url:        "http://127.0.0.1:8000",
		Node:       "example",
		Role:       commonv1.Role_ROLE_BOTH,
		Model:      "example-model",
	}, 30*time.Second)
	if err != nil {
		return err
	}
	fmt.Println("registered:", registered.Instance.Spec.InstanceId, "slot", registered.Instance.Slot)
	if !keep {
		defer func() {
			if _, err := client.Deregister(ctx, instanceID); err != nil {
				fmt.Fprintln(os.Stderr, "deregister:", err)
				return
			}
			fmt.Println("deregistered", instanceID)
		}()
	}
	// 40 tokens = two full blocks of 16 (the Conductor's default block size) + 8 more; the
	// second hash is above 2^63 (block hashes are uint64 end to end). Packed: 8 bytes each,
	// which the Conductor reads faster than the repeated block_hashes.
	hashes := kvsched.PackHashes([]uint64{0x1234, 0xFFFFFFFFFFFFFFC5})
	request := &conductorv1.ScheduleRequest{
		PromptTokens: 40, OutputTokens: 16, PackedBlockHashes: hashes,
	}
	decision, err := client.Schedule(ctx, request)
	switch {
	case errors.Is(err, kvsched.ErrRejected):
		delay, _ := kvsched.RetryAfter(err)
		fmt.Printf("rejected: %v (retry after %s)\n", err, delay)
	case err != nil:
		return err
	default:
		fmt.Printf("request %s -> %s (rule %s, policy %s)\n", request.RequestId,
			decision.InstanceId, decision.Rule, decision.Policy)
		finished, err := client.Finish(ctx, &conductorv1.FinishRequest{
			RequestId:         request.RequestId,
			InstanceId:        decision.InstanceId,
			DecodeInstanceId:  decision.DecodeInstanceId,
			PromptTokens:      40,
			OutputTokens:      16,
			PackedBlockHashes: hashes,
			Ok:                true,
		})
		if err != nil {
			return err
		}
		fmt.Printf("finished: %d transfers to start\n", len(finished.Transfers))
	}
	instances, err := client.ListInstances(ctx)
	if err != nil {
		return err
	}
	for _, status := range instances {
		fmt.Printf("instance %s slot=%d role=%s in_flight=%d gpu_blocks=%d\n",
			status.Spec.InstanceId, status.Slot, status.Spec.Role, status.InFlight, status.GpuBlocks)
	}
	return nil
}
