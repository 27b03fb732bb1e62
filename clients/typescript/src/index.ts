/** kvsched's TypeScript client: `ConductorClient` (follows the leader), its errors, and the
 * generated messages and service descriptors (protoc-gen-es) for everything else. */

export { Backoff, seededRandom } from "./backoff.js";
export {
  Channels,
  type ConductorStub,
  normalizeAddress,
  sessionOptions,
  type TlsOptions,
} from "./channels.js";
export { ConductorClient, type ConductorClientOptions } from "./conductor.js";
export {
  ConductorError,
  errorFor,
  fromCallError,
  InvalidRequest,
  LEADER_TRAILER,
  NotFound,
  Rejected,
  RETRY_AFTER_TRAILER,
  statusName,
  Unavailable,
} from "./errors.js";
export { LeaderFinder } from "./leader.js";
export {
  badHash,
  blockHash,
  duration,
  HASH_BYTES,
  milliseconds,
  packHashes,
  U64_MAX,
  unpackHashes,
} from "./values.js";
export * as common from "./gen/kvsched/common/v1/common_pb.js";
export * as conductor from "./gen/kvsched/conductor/v1/conductor_service_pb.js";
export * as messenger from "./gen/kvsched/messenger/v1/messenger_service_pb.js";
export * as router from "./gen/kvsched/router/v1/router_service_pb.js";
export { Code } from "@connectrpc/connect";
