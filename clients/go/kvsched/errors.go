package kvsched

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The trailers a Conductor answers with.
const (
	// LeaderTrailer names the leader's address on a standby's refusal of a write (empty
	// while an election runs).
	LeaderTrailer = "kvsched-leader"
	// RetryAfterTrailer carries a refusal's retry delay in milliseconds.
	RetryAfterTrailer = "retry-after-ms"
)

// What a failure means to the caller; match an *Error against them with errors.Is.
var (
	// ErrRejected: RESOURCE_EXHAUSTED, no instance can meet the latency objectives (or the
	// Conductor is overloaded); try again after RetryAfter(err).
	ErrRejected = errors.New("kvsched: rejected")
	// ErrInvalidRequest: INVALID_ARGUMENT, the request is malformed; retrying will not help.
	ErrInvalidRequest = errors.New("kvsched: invalid request")
	// ErrNotFound: NOT_FOUND, no such instance, session or transfer.
	ErrNotFound = errors.New("kvsched: not found")
	// ErrUnavailable: no leader (or no Conductor at all) answered within the retry budget:
	// UNAVAILABLE, DEADLINE_EXCEEDED, or FAILED_PRECONDITION from standbys that kept refusing.
	ErrUnavailable = errors.New("kvsched: unavailable")
	// ErrClosed: the client was closed (the error's code is CANCELLED).
	ErrClosed = errors.New("kvsched: client closed")
)

// Error is a failed Conductor call: the gRPC status, the server's trailing metadata, and a
// refusal's retry delay. It never wraps a raw gRPC error; status.Code(err) still works.
type Error struct {
	Code    codes.Code
	Message string
	// RetryAfter is the server's retry delay; HasRetryAfter says whether it gave one.
	RetryAfter    time.Duration
	HasRetryAfter bool
	// Trailers holds the first value of each trailing metadata key (keys lower case).
	Trailers map[string]string
	// gaveUp marks the error that ends a call's retries (ErrUnavailable whatever Code is).
	gaveUp bool
	closed bool
	cause  error // the caller's context error, when its context ended the call
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %s", codeName(e.Code), e.Message) }

// Is matches the sentinel errors above (ErrRejected, ErrNotFound, ...).
func (e *Error) Is(target error) bool {
	switch target {
	case ErrRejected:
		return e.Code == codes.ResourceExhausted
	case ErrInvalidRequest:
		return e.Code == codes.InvalidArgument
	case ErrNotFound:
		return e.Code == codes.NotFound
	case ErrUnavailable:
		return e.gaveUp || e.Code == codes.Unavailable || e.Code == codes.DeadlineExceeded
	case ErrClosed:
		return e.closed
	}
	return false
}

// Unwrap is the caller's context error (context.Canceled or context.DeadlineExceeded) when
// the caller's context ended the call, else nil.
func (e *Error) Unwrap() error { return e.cause }

// GRPCStatus lets status.Code and status.FromError read the code and message.
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// RetryAfter is the retry delay a failed call carried, if any (a rejection's, usually).
func RetryAfter(err error) (time.Duration, bool) {
	var e *Error
	if errors.As(err, &e) && e.HasRetryAfter {
		return e.RetryAfter, true
	}
	return 0, false
}

// newError builds the *Error for a status and trailers; the retry delay is read from the
// "retry-after-ms" trailer (a malformed one is ignored).
func newError(code codes.Code, message string, trailers map[string]string) *Error {
	e := &Error{Code: code, Message: message, Trailers: trailers}
	if e.Trailers == nil {
		e.Trailers = map[string]string{}
	}
	if raw, ok := e.Trailers[RetryAfterTrailer]; ok {
		if ms, err := strconv.ParseFloat(strings.TrimSpace(raw), 64); err == nil && ms >= 0 {
			e.RetryAfter = time.Duration(ms * float64(time.Millisecond))
			e.HasRetryAfter = true
		}
	}
	return e
}

// fromCall turns a failed call's error and trailing metadata into an *Error.
func fromCall(err error, md metadata.MD) *Error {
	s, _ := status.FromError(err) // a non-status error becomes UNKNOWN
	trailers := make(map[string]string, len(md))
	for key, values := range md {
		if len(values) > 0 {
			trailers[strings.ToLower(key)] = values[0]
		}
	}
	return newError(s.Code(), s.Message(), trailers)
}

func closedError() *Error {
	return &Error{Code: codes.Canceled, Message: "the client is closed", Trailers: map[string]string{}, closed: true}
}

// codeName is the status code's name as gRPC spells it (RESOURCE_EXHAUSTED, ...).
func codeName(c codes.Code) string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return c.String()
}

var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
	codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
	codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
	codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED",
	codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS",
	codes.Unauthenticated: "UNAUTHENTICATED",
}
