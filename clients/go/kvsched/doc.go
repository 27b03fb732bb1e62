// Package kvsched is a typed client for kvsched.conductor.v1.ConductorService that follows
// the leader, as the Python client (clients/python) does.
//
// Writes go to the leader. A standby refuses them with FAILED_PRECONDITION and the leader's
// address in the "kvsched-leader" trailer: the client switches to that address at once (an
// empty trailer means an election is running, so it looks for the leader again after a
// backoff). UNAVAILABLE is retried for every call and DEADLINE_EXCEEDED only for idempotent
// calls, with exponential backoff and jitter, up to Options.Retries times. Failures come back
// as *Error: errors.Is(err, ErrRejected) and RetryAfter(err) read a refusal's retry delay
// (the "retry-after-ms" trailer).
//
// The generated messages and stubs are in kvsched/clients/go/gen/kvsched/<service>/v1
// (block hashes are uint64, as the protos' fixed64 fields: every value round-trips).
package kvsched
