/** Retry delays: exponential backoff with jitter drawn from a seeded generator, so a run with
 * a given seed waits the same delays (the Python client's `_backoff`). */

/** A seeded uniform generator in [0, 1) (mulberry32); `Math.random` when no seed is given. */
export function seededRandom(seed: number | undefined): () => number {
  if (seed === undefined) return Math.random;
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Delays for attempt 0, 1, 2...: uniform in [cap/2, cap], cap = min(maxMs, baseMs * 2^attempt). */
export class Backoff {
  private readonly random: () => number;

  constructor(
    readonly baseMs: number,
    readonly maxMs: number,
    seed?: number,
  ) {
    if (!(baseMs >= 0 && maxMs >= baseMs)) {
      throw new RangeError("need 0 <= backoffMs <= maxBackoffMs");
    }
    this.random = seededRandom(seed);
  }

  /** The delay before retry number `attempt + 1`, in milliseconds. */
  delayMs(attempt: number): number {
    const cap = Math.min(this.maxMs, this.baseMs * 2 ** attempt);
    return cap / 2 + this.random() * (cap / 2);
  }
}

/** Resolves after `ms` milliseconds. */
export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
