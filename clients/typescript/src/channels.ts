/**
 * Channels to the Conductors: one HTTP/2 connection (gRPC transport) per address, opened on
 * first use with the client's TLS material and interceptors, each with its ConductorService
 * client. Mirrors clients/python/channels.py.
 */

import { readFileSync } from "node:fs";
import type { SecureClientSessionOptions } from "node:http2";

import { type Client, createClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import { ConductorService } from "./gen/kvsched/conductor/v1/conductor_service_pb.js";

/** A generated ConductorService client on one Conductor's connection. */
export type ConductorStub = Client<typeof ConductorService>;

/**
 * TLS towards the Conductors (which serve mutual TLS unless started `--insecure`): the CA
 * their certificates chain to, and this client's certificate and key (its identity decides
 * which RPCs it may call: a `router/...` one to schedule, a `messenger/<node>` one to register
 * that node's instances, an `admin/...` one for SetPolicy; docs/security.md). Each is a PEM
 * file path, or the PEM itself as a Buffer.
 */
export interface TlsOptions {
  ca: string | Buffer;
  cert?: string | Buffer;
  key?: string | Buffer;
}

/** HTTP/2 settings of one connection, as node:http2 takes them; undefined: plaintext. */
export type SessionOptions = SecureClientSessionOptions | undefined;

/** The node:http2 options for `tls` (read from disk now), or undefined for plaintext. */
export function sessionOptions(tls: TlsOptions | undefined): SessionOptions {
  if (tls === undefined) return undefined;
  if ((tls.cert === undefined) !== (tls.key === undefined)) {
    throw new TypeError("TLS cert and key go together");
  }
  const read = (pem: string | Buffer): Buffer =>
    typeof pem === "string" ? readFileSync(pem) : pem;
  return {
    ca: read(tls.ca),
    ...(tls.cert !== undefined ? { cert: read(tls.cert) } : {}),
    ...(tls.key !== undefined ? { key: read(tls.key) } : {}),
  };
}

/** `host:port` from an address that may carry a scheme or a trailing slash. */
export function normalizeAddress(address: string): string {
  let out = address.trim().replace(/\/+$/, "");
  for (const scheme of ["grpc://", "grpcs://", "http://", "https://"]) {
    if (out.startsWith(scheme)) {
      out = out.slice(scheme.length);
      break;
    }
  }
  return out;
}

/** The open connections by address; `stub` opens one, `close` closes them all. */
export class Channels {
  private readonly open = new Map<string, { session: Http2SessionManager; stub: ConductorStub }>();

  constructor(
    private readonly options: SessionOptions,
    private readonly interceptors: readonly Interceptor[],
  ) {}

  /** The client on the connection to `address` (opened now if it is not open). */
  stub(address: string): ConductorStub {
    let entry = this.open.get(address);
    if (entry === undefined) {
      const baseUrl = `${this.options === undefined ? "http" : "https"}://${address}`;
      // Our own session manager, so that `close` can end the connection; it reconnects by
      // itself on the next call after the Conductor went away (a restarted standby).
      const session = new Http2SessionManager(baseUrl, {}, this.options);
      const transport = createGrpcTransport({
        baseUrl,
        sessionManager: session,
        interceptors: [...this.interceptors],
      });
      entry = { session, stub: createClient(ConductorService, transport) };
      this.open.set(address, entry);
    }
    return entry.stub;
  }

  /** Close every open connection (calls on them end CANCELLED or UNAVAILABLE). */
  close(): void {
    const entries = [...this.open.values()];
    this.open.clear();
    for (const { session } of entries) session.abort();
  }
}
