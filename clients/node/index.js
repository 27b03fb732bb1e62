'use strict';
// Node.js client for the kvsched ConductorService, loaded at run time from the repository's protos.
//
// Field names are camelCase (proto-loader's default), enums are their string names
// ("ROLE_BOTH"), and 64-bit integers in answers (block hashes, tokens, lease ids) are decimal
// strings: block hashes are unsigned, so BigInt(s) gives the exact value back.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const CONDUCTOR_PROTO = 'kvsched/conductor/v1/conductor_service.proto';
/** Trailing metadata key with which a standby names the leader's gRPC address. */
const LEADER_METADATA_KEY = 'kvsched-leader';
/** Trailing metadata key of a Schedule rejection (RESOURCE_EXHAUSTED): milliseconds to wait. */
const RETRY_AFTER_METADATA_KEY = 'retry-after-ms';
const U64_MAX = (1n << 64n) - 1n;
// RPCs only the leader answers; a standby refuses them with FAILED_PRECONDITION.
const WRITES = new Set([
  'RegisterInstance', 'KeepAliveInstance', 'DeregisterInstance', 'PublishKvEvents',
  'Schedule', 'Finish', 'ReportTransfer', 'SetPolicy',
]);

/**
 * Loads ConductorService from the protos.
 * @param {string} [protoRoot] directory holding `kvsched/...` (default: the repository's protos/)
 * @returns {typeof grpc.Client} the generated client constructor; its `.service` holds the
 *   method definitions (with their serializers).
 */
function loadConductor(protoRoot = DEFAULT_PROTO_ROOT) {
  const definition = protoLoader.loadSync(CONDUCTOR_PROTO, {
    includeDirs: [protoRoot],
    longs: String, // fixed64/uint64 as decimal strings: no precision loss above 2^53
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).kvsched.conductor.v1.ConductorService;
}

/**
 * An unsigned 64-bit block hash as the decimal string proto-loader encodes exactly.
 * @param {bigint | string | number} hash
 * @returns {string}
 */
function toU64(hash) {
  if (typeof hash === 'number' && !Number.isSafeInteger(hash)) {
    throw new RangeError(`block hash ${hash} is not a safe integer: pass a BigInt or a string`);
  }
  const value = BigInt(hash);
  if (value < 0n || value > U64_MAX) throw new RangeError(`block hash ${hash} is not an unsigned 64-bit value`);
  return value.toString();
}

/** @param {number} ms @returns {{seconds: string, nanos: number}} a google.protobuf.Duration */
function msToDuration(ms) {
  const whole = Math.floor(ms / 1000);
  return { seconds: String(whole), nanos: Math.round((ms - whole * 1000) * 1e6) };
}

/** @param {{seconds?: string | number, nanos?: number} | null | undefined} d @returns {number} milliseconds */
function durationMs(d) {
  return d ? Number(d.seconds || 0) * 1000 + (d.nanos || 0) / 1e6 : 0;
}

/** "host:port" from an address that may carry a scheme (grpc://, http://) or a trailing slash. */
function normalizeAddress(address) {
  return String(address).trim().replace(/^(grpcs?|https?):\/\//, '').replace(/\/+$/, '');
}

/** @param {Error & {metadata?: grpc.Metadata}} err @param {string} key @returns {string | undefined} */
function trailer(err, key) {
  const values = err.metadata ? err.metadata.get(key) : [];
  return values.length ? String(values[0]) : undefined;
}

/**
 * @typedef {object} ClientOptions
 * @property {number} [deadlineMs=2000] deadline of each attempt
 * @property {grpc.ChannelCredentials} [credentials] overrides everything below
 * @property {string} [ca] PEM file of the CA that signed the Conductor's certificate (enables TLS)
 * @property {string} [cert] PEM client certificate file (mutual TLS, with `key`)
 * @property {string} [key] PEM client private key file
 * @property {boolean} [tls=false] TLS with the system's roots when no `ca` is given
 * @property {string} [protoRoot] directory of the protos (default: the repository's protos/)
 */

/** A ConductorService client that follows the leader. */
class ConductorClient {
  /**
   * @param {string[] | string} addresses Conductor addresses ("host:port"); a string may list
   *   several separated by commas.
   * @param {ClientOptions} [options]
   */
  constructor(addresses, options = {}) {
    const list = (Array.isArray(addresses) ? addresses : String(addresses).split(','))
      .map(normalizeAddress).filter(Boolean);
    if (list.length === 0) throw new Error('ConductorClient: no Conductor address given');
    /** @type {string[]} every address known, configured or learned from a redirect */
    this.addresses = [...new Set(list)];
    /** @type {string} the address calls go to (the leader, once known) */
    this.address = this.addresses[0];
    this.deadlineMs = options.deadlineMs ?? 2000;
    this.credentials = options.credentials ?? makeCredentials(options);
    this.Service = loadConductor(options.protoRoot);
    /** @type {Map<string, grpc.Client>} */
    this.stubs = new Map();
  }

  /**
   * Registers (or re-registers) an engine instance.
   * @param {{instanceId: string, url: string, node: string, role: string, model: string,
   *   messengerUrl?: string, leaseTtlMs?: number}} spec role e.g. "ROLE_BOTH" (or "BOTH")
   * @returns {Promise<{instance: object, leaseTtl: object}>}
   */
  registerInstance({ instanceId, url, node, role, model, messengerUrl = '', leaseTtlMs = 0 }) {
    const roleName = role && !String(role).startsWith('ROLE_') ? `ROLE_${role}` : role;
    return this.call('RegisterInstance', {
      spec: { instanceId, url, node, role: roleName, model, messengerUrl },
      leaseTtl: msToDuration(leaseTtlMs),
    });
  }

  /** @param {string} instanceId @returns {Promise<{leaseTtl: object, nextEventSequence: string}>} */
  keepAliveInstance(instanceId) {
    return this.call('KeepAliveInstance', { instanceId });
  }

  /** @param {string} instanceId @returns {Promise<{sessionsUnbound: number}>} */
  deregisterInstance(instanceId) {
    return this.call('DeregisterInstance', { instanceId });
  }

  /** @returns {Promise<object[]>} the registered instances (InstanceStatus), by slot */
  async listInstances() {
    return (await this.call('ListInstances', {})).instances;
  }

  /**
   * Places one request. A rejection throws RESOURCE_EXHAUSTED with `err.retryAfterMs` set.
   * @param {{requestId: string, promptTokens: number, outputTokens?: number,
   *   blockHashes?: Array<bigint | string>, sessionId?: string, explain?: boolean}} request
   * @returns {Promise<object>} the Decision (instanceId, instanceUrl, rule, policy, ...)
   */
  async schedule({ requestId = '', promptTokens = 0, outputTokens = 0, blockHashes = [], sessionId = '', explain = false }) {
    const response = await this.call('Schedule', {
      requestId, promptTokens, outputTokens, blockHashes: blockHashes.map(toU64), sessionId, explain,
    });
    return response.decision;
  }

  /**
   * Reports that a request ended.
   * @param {{requestId: string, sessionId?: string, instanceId: string, decodeInstanceId?: string,
   *   promptTokens?: number, outputTokens?: number, cachedTokens?: number,
   *   blockHashes?: Array<bigint | string>, timeToFirstTokenMs?: number, endToEndMs?: number,
   *   ok?: boolean}} report
   * @returns {Promise<{transfers: object[]}>} transfers to start now
   */
  finish({ timeToFirstTokenMs = 0, endToEndMs = 0, blockHashes = [], ok = true, ...rest }) {
    return this.call('Finish', {
      ...rest, ok, blockHashes: blockHashes.map(toU64),
      timeToFirstToken: msToDuration(timeToFirstTokenMs), endToEnd: msToDuration(endToEndMs),
    });
  }

  /** @returns {Promise<{selfId: string, isLeader: boolean, leaderId: string, leaderUrl: string, leaderHttpUrl: string}>} */
  getLeader() {
    return this.call('GetLeader', {});
  }

  /** @returns {Promise<{spec: string, params: Object<string, string>, available: string[]}>} */
  getPolicy() {
    return this.call('GetPolicy', {});
  }

  /** @param {string} spec `name` or `name:key=value,...` @returns {Promise<{previousSpec: string, spec: string}>} */
  setPolicy(spec) {
    return this.call('SetPolicy', { spec });
  }

  /**
   * How a prompt would be placed now; changes nothing.
   * @param {{blockHashes?: Array<bigint | string>, tokenIds?: number[], promptTokens?: number,
   *   outputTokens?: number, sessionId?: string}} query
   * @returns {Promise<{decision: object, rejected: boolean}>}
   */
  explain({ blockHashes = [], ...rest }) {
    return this.call('Explain', { ...rest, blockHashes: blockHashes.map(toU64) });
  }

  /**
   * Any unary ConductorService method, with the leader handling: a write refused by a standby
   * (FAILED_PRECONDITION + `kvsched-leader` trailer) is retried once at the leader; on
   * UNAVAILABLE the other addresses are asked for the leader and the call is retried once there.
   * @param {string} method e.g. "GetSession", "ReportTransfer"
   * @param {object} request the request message, camelCase
   * @returns {Promise<object>} the response message
   */
  async call(method, request) {
    let redirected = false;
    let failedOver = false;
    for (;;) {
      const address = this.address;
      try {
        return await this.#unary(address, method, request);
      } catch (err) {
        const leader = trailer(err, LEADER_METADATA_KEY);
        if (err.code === grpc.status.FAILED_PRECONDITION && leader && !redirected) {
          redirected = true;
          this.#use(leader);
          continue;
        }
        if (err.code === grpc.status.UNAVAILABLE && !failedOver) {
          failedOver = true;
          const next = await this.#findLeader(address, WRITES.has(method));
          if (next) {
            this.#use(next);
            continue;
          }
        }
        const retryAfter = trailer(err, RETRY_AFTER_METADATA_KEY);
        if (retryAfter !== undefined) err.retryAfterMs = Number(retryAfter);
        if (leader) err.leader = leader;
        err.address = address;
        throw err;
      }
    }
  }

  /** Closes every channel. */
  close() {
    for (const stub of this.stubs.values()) stub.close();
    this.stubs.clear();
  }

  #use(address) {
    this.address = normalizeAddress(address);
    if (!this.addresses.includes(this.address)) this.addresses.push(this.address);
  }

  #stub(address) {
    let stub = this.stubs.get(address);
    if (!stub) {
      stub = new this.Service(address, this.credentials);
      this.stubs.set(address, stub);
    }
    return stub;
  }

  #unary(address, method, request) {
    const stub = this.#stub(address);
    if (typeof stub[method] !== 'function') {
      return Promise.reject(new TypeError(`ConductorService has no unary method ${method}`));
    }
    const deadline = Date.now() + this.deadlineMs;
    return new Promise((resolve, reject) => {
      stub[method](request, new grpc.Metadata(), { deadline }, (err, response) => (err ? reject(err) : resolve(response)));
    });
  }

  /**
   * Asks the addresses other than `failed` who leads. Returns the leader's address; for a read
   * (`needLeader` false), any Conductor that answered will do when no leader is known.
   */
  async #findLeader(failed, needLeader) {
    let reachable;
    for (const address of this.addresses.filter((a) => a !== failed)) {
      try {
        const info = await this.#unary(address, 'GetLeader', {});
        if (info.isLeader) return address;
        const leader = normalizeAddress(info.leaderUrl || '');
        if (leader && leader !== failed) return leader;
        reachable ??= address;
      } catch {
        // unreachable too: try the next one
      }
    }
    return needLeader ? undefined : reachable;
  }
}

/** @param {ClientOptions} options @returns {grpc.ChannelCredentials} */
function makeCredentials({ ca, cert, key, tls = false }) {
  if (!ca && !cert && !key && !tls) return grpc.credentials.createInsecure();
  if (Boolean(cert) !== Boolean(key)) throw new Error('ConductorClient: cert and key go together (mutual TLS)');
  const read = (file) => (file ? fs.readFileSync(file) : null);
  return grpc.credentials.createSsl(read(ca), read(key), read(cert));
}

module.exports = {
  ConductorClient,
  loadConductor,
  toU64,
  durationMs,
  msToDuration,
  grpcStatus: grpc.status,
  LEADER_METADATA_KEY,
  RETRY_AFTER_METADATA_KEY,
  DEFAULT_PROTO_ROOT,
};
