/**
 * Fake Conductors for the offline tests: real gRPC servers on loopback (connect-node's
 * adapter on node:http2) whose ConductorService answers as a leader, a standby naming a
 * leader, or an overloaded leader would, and count the calls they get.
 */

import { createServer, type Http2Server, type ServerHttp2Session } from "node:http2";
import type { AddressInfo } from "node:net";

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";

import {
  ConductorService,
  type ScheduleRequest,
  DecisionSchema,
} from "../src/gen/kvsched/conductor/v1/conductor_service_pb.js";

/** How a fake answers writes: leads, refuses naming `leader` ("" while an election runs),
 * or refuses every placement with a retry delay. */
export type Behaviour =
  | { kind: "leader" }
  | { kind: "standby"; leader: string }
  | { kind: "overloaded"; retryAfterMs: string };

/** One fake Conductor; `behaviour` may change between calls. */
export class FakeConductor {
  readonly calls: string[] = [];
  readonly scheduled: ScheduleRequest[] = [];
  address = "";
  private server: Http2Server | undefined;
  private readonly sessions = new Set<ServerHttp2Session>();

  constructor(
    readonly id: string,
    public behaviour: Behaviour,
  ) {}

  private refuse(): void {
    const b = this.behaviour;
    if (b.kind === "standby") {
      throw new ConnectError("not the leader", Code.FailedPrecondition, {
        "kvsched-leader": b.leader,
      });
    }
  }

  private routes = (router: ConnectRouter): void => {
    router.service(ConductorService, {
      getLeader: () => {
        this.calls.push("GetLeader");
        const b = this.behaviour;
        return {
          selfId: this.id,
          isLeader: b.kind !== "standby",
          leaderUrl: b.kind === "standby" ? b.leader : this.address,
        };
      },
      schedule: (request) => {
        this.calls.push("Schedule");
        this.refuse();
        this.scheduled.push(request);
        const b = this.behaviour;
        if (b.kind === "overloaded") {
          throw new ConnectError("no instance meets the SLO", Code.ResourceExhausted, {
            "retry-after-ms": b.retryAfterMs,
          });
        }
        if (request.promptTokens === 0) {
          throw new ConnectError("prompt_tokens must be positive", Code.InvalidArgument);
        }
        const decision = create(DecisionSchema, {
          requestId: request.requestId,
          instanceId: `${this.id}/engine-0`,
          cachedTokens: request.blockHashes.length * 16,
        });
        return { decision };
      },
      listInstances: () => {
        this.calls.push("ListInstances");
        return { instances: [] };
      },
    });
  };

  /** Listen on loopback, on `port` (default: a free one); returns the address. */
  async start(port = 0): Promise<string> {
    const handler = connectNodeAdapter({
      routes: this.routes,
      grpc: true,
      connect: false,
      grpcWeb: false,
    });
    const server = createServer(handler);
    server.on("session", (session: ServerHttp2Session) => {
      this.sessions.add(session);
      session.on("close", () => this.sessions.delete(session));
    });
    await new Promise<void>((resolve) => server.listen(port, "127.0.0.1", resolve));
    this.server = server;
    this.address = `127.0.0.1:${(server.address() as AddressInfo).port}`;
    return this.address;
  }

  /** Stop listening and drop every connection (as a killed process would). */
  async stop(): Promise<void> {
    const server = this.server;
    this.server = undefined;
    if (server === undefined) return;
    await new Promise<void>((resolve) => {
      server.close(() => resolve());
      // close() waits for open sessions: end them, so that calls fail at once.
      for (const session of this.sessions) session.destroy();
    });
  }
}
