/**
 * Values the protos carry that JavaScript numbers cannot: uint64 block hashes (bigint, the
 * whole range up to 2^64 - 1) and google.protobuf.Duration (from and to milliseconds).
 */

import { create } from "@bufbuild/protobuf";
import { type Duration, DurationSchema } from "@bufbuild/protobuf/wkt";

export const U64_MAX = (1n << 64n) - 1n;

/**
 * A block hash as the bigint the generated code sends: from a bigint, a decimal or `0x`
 * string, or a safe integer. Throws RangeError for anything outside [0, 2^64 - 1] (a hash
 * above 2^63 is a valid unsigned value, never a negative one).
 */
export function blockHash(value: bigint | string | number): bigint {
  if (typeof value === "number" && !Number.isSafeInteger(value)) {
    throw new RangeError(`block hash ${value} is not a safe integer: pass a bigint or a string`);
  }
  let hash: bigint;
  try {
    hash = BigInt(value);
  } catch {
    throw new RangeError(`block hash ${String(value)} is not an integer`);
  }
  if (hash < 0n || hash > U64_MAX) {
    throw new RangeError(`block hash ${String(value)} is not an unsigned 64-bit value`);
  }
  return hash;
}

/** The first of `hashes` outside the uint64 range, described; undefined when all fit. */
export function badHash(hashes: Iterable<bigint> | undefined, field: string): string | undefined {
  for (const hash of hashes ?? []) {
    if (typeof hash !== "bigint" || hash < 0n || hash > U64_MAX) {
      return `${field}: ${String(hash)} is not an unsigned 64-bit bigint`;
    }
  }
  return undefined;
}

/** Bytes of one packed block hash. */
export const HASH_BYTES = 8;

/**
 * Block hashes as the `packedBlockHashes` fields carry them: each uint64 little-endian, 8
 * bytes, one after the other (set it instead of `blockHashes`, never both: the Conductor reads
 * the packed form faster). Throws RangeError for a value outside [0, 2^64 - 1].
 */
export function packHashes(hashes: readonly bigint[]): Uint8Array {
  const out = new Uint8Array(HASH_BYTES * hashes.length);
  const view = new DataView(out.buffer);
  hashes.forEach((hash, i) => {
    const bad = badHash([hash], `hash ${i}`);
    if (bad !== undefined) throw new RangeError(bad);
    view.setBigUint64(HASH_BYTES * i, hash, true);
  });
  return out;
}

/** Packed block hashes read back; throws RangeError unless the length is a multiple of 8. */
export function unpackHashes(data: Uint8Array): bigint[] {
  if (data.length % HASH_BYTES !== 0) {
    throw new RangeError(`${data.length} bytes are not a whole number of 8-byte hashes`);
  }
  const view = new DataView(data.buffer, data.byteOffset, data.length);
  return Array.from({ length: data.length / HASH_BYTES }, (_, i) =>
    view.getBigUint64(HASH_BYTES * i, true),
  );
}

/** A Duration of `ms` milliseconds (rounded to the nanosecond). */
export function duration(ms: number): Duration {
  if (!Number.isFinite(ms) || ms < 0) throw new RangeError(`duration ${ms} ms: need >= 0`);
  const nanos = BigInt(Math.round(ms * 1e6));
  return create(DurationSchema, {
    seconds: nanos / 1_000_000_000n,
    nanos: Number(nanos % 1_000_000_000n),
  });
}

/** A Duration in milliseconds (0 for none). */
export function milliseconds(d: Duration | undefined): number {
  return d === undefined ? 0 : Number(d.seconds) * 1000 + d.nanos / 1e6;
}
