/**
 * Finding the Conductor that leads: `LeaderFinder` keeps the address believed to lead and
 * asks the Conductors (GetLeader) when it does not know or that address failed. Mirrors
 * clients/python/leader.py.
 */

import { Code } from "@connectrpc/connect";

import { sleep } from "./backoff.js";
import { type Channels, normalizeAddress } from "./channels.js";
import { fromCallError, Unavailable } from "./errors.js";
import type { GetLeaderResponse } from "./gen/kvsched/conductor/v1/conductor_service_pb.js";

/** What the finder needs of its client. */
export interface LeaderFinderOptions {
  /** Deadline of each GetLeader, in milliseconds. */
  deadlineMs: number;
  /** Rounds of asking repeated (after a backoff) while an election runs. */
  retries: number;
  /** The delay before round `attempt + 1`, in milliseconds. */
  backoffMs: (attempt: number) => number;
  /** Throws once the client is closed. */
  checkOpen: () => void;
}

/**
 * The leader as far as the client knows (`current`), and how it finds out: each address is
 * asked in turn until one leads or names a leader that confirms; the round is repeated after
 * a backoff while an election runs, up to `retries` more rounds.
 */
export class LeaderFinder {
  /** The address believed to lead (undefined when unknown). */
  current: string | undefined;
  private next = 0; // round-robin position in `addresses`
  private discovering: Promise<string> | undefined; // one discovery for many callers

  constructor(
    readonly addresses: readonly string[],
    private readonly channels: Channels,
    private readonly options: LeaderFinderOptions,
  ) {}

  /** Where a read goes: the believed leader (the freshest answer), else the next address
   * (reads are answered everywhere). */
  readTarget(): string {
    return this.current ?? this.addresses[this.next % this.addresses.length]!;
  }

  /** Another Conductor named `address` as the leader: use it from now. */
  follow(address: string): void {
    this.current = address;
  }

  /** `address` failed: stop treating it as the leader and move reads elsewhere. */
  forget(address: string): void {
    if (this.current === address) this.current = undefined;
    if (this.addresses[this.next % this.addresses.length] === address) this.next += 1;
  }

  /** Ask the Conductors who leads; returns the leader's address and uses it from now.
   * Throws `Unavailable`. */
  find(): Promise<string> {
    return this.once();
  }

  /** The believed leader, found first when there is none. */
  async ensure(): Promise<string> {
    return this.current ?? (await this.once());
  }

  private once(): Promise<string> {
    this.discovering ??= this.discover().finally(() => {
      this.discovering = undefined;
    });
    return this.discovering;
  }

  /** Ask each address in turn; a leader another Conductor names is asked too, and only
   * taken once it confirms (a standby's answer may be stale). */
  private async discover(): Promise<string> {
    let last = "no answer";
    const n = this.addresses.length;
    for (let round = 0; round <= this.options.retries; round++) {
      if (round > 0) await sleep(this.options.backoffMs(round - 1));
      const asked = new Set<string>();
      for (let i = 0; i < n; i++) {
        const address = this.addresses[this.next % n]!;
        if (!asked.has(address)) {
          asked.add(address);
          const answer = await this.ask(address);
          if (typeof answer === "string") {
            last = answer;
          } else if (answer.isLeader) {
            this.current = address; // the address we reached beats the advertised one
            return address;
          } else {
            const named = normalizeAddress(answer.leaderUrl);
            last = `${address}: not the leader; leader ${named || "(election running)"}`;
            if (named && !asked.has(named)) {
              asked.add(named);
              const confirm = await this.ask(named);
              if (typeof confirm === "string") {
                last = confirm;
              } else if (confirm.isLeader) {
                this.current = named;
                return named;
              }
            }
          }
        }
        this.next += 1;
      }
    }
    throw new Unavailable(
      Code.Unavailable,
      `no Conductor leader found at ${this.addresses.join(", ")}; last: ${last}`,
    );
  }

  /** GetLeader at one address, or why it did not answer. */
  private async ask(address: string): Promise<GetLeaderResponse | string> {
    this.options.checkOpen();
    try {
      return await this.channels
        .stub(address)
        .getLeader({}, { timeoutMs: this.options.deadlineMs });
    } catch (err) {
      this.options.checkOpen(); // closed under the call: say so, not "unavailable"
      const failure = fromCallError(err);
      return `${address}: ${failure.codeName} ${failure.detail}`;
    }
  }
}
