/**
 * How failed Conductor calls reach the caller: `ConductorError` and its subclasses, one per
 * status the caller acts on, built from a connect error with the server's trailers (a
 * refusal's `retry-after-ms`, a standby's `kvsched-leader`). Mirrors clients/python/errors.py.
 */

import { Code, ConnectError } from "@connectrpc/connect";

/** Trailer in which a standby names the leader's gRPC address (empty: an election runs). */
export const LEADER_TRAILER = "kvsched-leader";
/** Trailer of a refusal (RESOURCE_EXHAUSTED): milliseconds to wait before trying again. */
export const RETRY_AFTER_TRAILER = "retry-after-ms";

/** gRPC status names by number, as the Python client and grpc tools print them. */
const STATUS_NAMES: Readonly<Record<number, string>> = {
  [Code.Canceled]: "CANCELLED",
  [Code.Unknown]: "UNKNOWN",
  [Code.InvalidArgument]: "INVALID_ARGUMENT",
  [Code.DeadlineExceeded]: "DEADLINE_EXCEEDED",
  [Code.NotFound]: "NOT_FOUND",
  [Code.AlreadyExists]: "ALREADY_EXISTS",
  [Code.PermissionDenied]: "PERMISSION_DENIED",
  [Code.ResourceExhausted]: "RESOURCE_EXHAUSTED",
  [Code.FailedPrecondition]: "FAILED_PRECONDITION",
  [Code.Aborted]: "ABORTED",
  [Code.OutOfRange]: "OUT_OF_RANGE",
  [Code.Unimplemented]: "UNIMPLEMENTED",
  [Code.Internal]: "INTERNAL",
  [Code.Unavailable]: "UNAVAILABLE",
  [Code.DataLoss]: "DATA_LOSS",
  [Code.Unauthenticated]: "UNAUTHENTICATED",
};

/** The gRPC name of a status code ("RESOURCE_EXHAUSTED"). */
export function statusName(code: Code): string {
  return STATUS_NAMES[code] ?? `CODE_${code}`;
}

/** A call failed. `code` is the gRPC status, `trailers` the server's trailing metadata. */
export class ConductorError extends Error {
  /** Milliseconds the server asked to wait before retrying (undefined when it did not say). */
  readonly retryAfterMs: number | undefined;

  constructor(
    readonly code: Code,
    readonly detail: string,
    retryAfterMs?: number,
    readonly trailers: Readonly<Record<string, string>> = {},
  ) {
    super(`${statusName(code)}: ${detail}`);
    this.name = new.target.name;
    this.retryAfterMs = retryAfterMs;
  }

  /** The gRPC name of `code`. */
  get codeName(): string {
    return statusName(this.code);
  }
}

/** RESOURCE_EXHAUSTED: no instance can meet the latency objectives (or the Conductor is
 * overloaded); retry after `retryAfterMs`. */
export class Rejected extends ConductorError {}

/** INVALID_ARGUMENT: the request is malformed; retrying will not help. */
export class InvalidRequest extends ConductorError {}

/** NOT_FOUND: no such instance, session or transfer. */
export class NotFound extends ConductorError {}

/** No leader (or no Conductor at all) answered within the retry budget: UNAVAILABLE,
 * DEADLINE_EXCEEDED, or FAILED_PRECONDITION from standbys that kept refusing. */
export class Unavailable extends ConductorError {}

type ErrorClass = new (
  code: Code,
  detail: string,
  retryAfterMs?: number,
  trailers?: Readonly<Record<string, string>>,
) => ConductorError;

const ERRORS: ReadonlyMap<Code, ErrorClass> = new Map<Code, ErrorClass>([
  [Code.ResourceExhausted, Rejected],
  [Code.InvalidArgument, InvalidRequest],
  [Code.NotFound, NotFound],
  [Code.Unavailable, Unavailable],
  [Code.DeadlineExceeded, Unavailable],
]);

/** The `ConductorError` subclass for `code`; `retryAfterMs` from the trailers unless given. */
export function errorFor(
  code: Code,
  detail: string,
  trailers: Readonly<Record<string, string>> = {},
  retryAfterMs?: number,
): ConductorError {
  let delay = retryAfterMs;
  const carried = trailers[RETRY_AFTER_TRAILER];
  if (delay === undefined && carried !== undefined && carried.trim() !== "") {
    const parsed = Number(carried);
    if (Number.isFinite(parsed) && parsed >= 0) delay = parsed; // a garbled value says nothing
  }
  const Class = ERRORS.get(code) ?? ConductorError;
  return new Class(code, detail, delay, trailers);
}

/** Node error codes of a connection that failed or broke under the call (not an answer of
 * the server's): TLS verification as well, since a peer whose certificate does not verify
 * is as unreachable as one that does not listen. */
const CONNECTION_CODES: ReadonlySet<string> = new Set([
  "ECONNRESET",
  "ECONNREFUSED",
  "ECONNABORTED",
  "EPIPE",
  "ETIMEDOUT",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "ENOTFOUND",
  "EAI_AGAIN",
  "UNABLE_TO_VERIFY_LEAF_SIGNATURE",
  "DEPTH_ZERO_SELF_SIGNED_CERT",
  "SELF_SIGNED_CERT_IN_CHAIN",
  "CERT_HAS_EXPIRED",
  "ERR_TLS_CERT_ALTNAME_INVALID",
]);
const CONNECTION_PREFIXES = ["ERR_HTTP2_", "ERR_SSL_"];

/** The Node error code of a broken connection in `err`'s cause chain, if any. */
function connectionFailure(err: unknown): string | undefined {
  const seen = new Set<unknown>();
  for (let e = err; e instanceof Error && !seen.has(e); e = e.cause) {
    seen.add(e);
    const code = (e as { code?: unknown }).code;
    if (
      typeof code === "string" &&
      (CONNECTION_CODES.has(code) || CONNECTION_PREFIXES.some((p) => code.startsWith(p)))
    ) {
      return code;
    }
  }
  return undefined;
}

/**
 * What a failed call throws instead of the transport's error: the status, message and
 * metadata (headers and trailers by lower-case key; a repeated key's values joined by ", ").
 * A connection that failed or broke under the call is UNAVAILABLE, as in the other gRPC
 * libraries (connect-node says CANCELLED, ABORTED or INTERNAL for some), so that the call
 * is retried elsewhere.
 */
export function fromCallError(err: unknown): ConductorError {
  if (err instanceof ConductorError) return err;
  const failure = ConnectError.from(err);
  // No grpc-status: the server never answered. A stream the transport cancelled or aborted
  // (its HTTP/2 session died: the Conductor was killed) is a lost connection too; the
  // client's own cancellation (close) is told apart by the client before this.
  const answered = failure.metadata.get("grpc-status") !== null;
  const dropped = failure.code === Code.Canceled || failure.code === Code.Aborted;
  if (!answered && (dropped || connectionFailure(failure) !== undefined)) {
    return new Unavailable(Code.Unavailable, `connection lost: ${failure.rawMessage}`);
  }
  const trailers: Record<string, string> = {};
  failure.metadata.forEach((value, key) => {
    trailers[key.toLowerCase()] = value;
  });
  return errorFor(failure.code, failure.rawMessage, trailers);
}
