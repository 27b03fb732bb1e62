"""The etcd implementation of the `Store` interface (`services.common.store.interface`):
`EtcdStore`.

Modules: `store` (the `Store` operations), `connection` (endpoint failover, token renewal, the
one way calls run), `client` (the aetcd client, with TLS), `errors` (gRPC failures as
`StoreError`s) and `transactions` (key ranges, the transaction plan, the commit loop).

Semantics worth knowing:

* Keys and values are bytes. Prefix operations take the plain prefix (`b"/kvsched/v1/"`);
  `DeletePrefix`/`delete_prefix` refuse the empty prefix (that would wipe the whole keyspace).
* `snapshot(prefix)` returns every key under the prefix *as of one revision* (a first page of
  `page_size` keys, later pages of about `page_bytes` pinned to the first page's revision) and
  that revision, so `watch_prefix(prefix, revision + 1)` continues exactly where it left off.
  1M small keys take ~6-8 s (etcd ~4 s, building the `KeyValue`s ~2-3 s).
* `commit(ops)` applies the ops in order, in transactions of at most `MAX_TXN_OPS` ops (etcd's
  default `--max-txn-ops`) and about `MAX_TXN_BYTES` bytes (under etcd's default
  `--max-request-bytes`). etcd rejects a transaction that puts one key twice or puts a key that
  the same transaction deletes, so a new transaction is also started before such an op: order
  is preserved, each transaction is atomic, the batch as a whole is not. If a transaction fails
  because a `Put` is bound to a lease that no longer exists (expired or revoked), the puts bound
  to the missing leases are dropped and the transaction is retried without them; the count is
  returned in `CommitResult.dropped_puts`. Any other failure raises and leaves the earlier
  transactions applied.
* Endpoints are tried in order on `connect()`; the first that answers is used. When a call
  fails because that endpoint became unreachable the call raises `StoreUnavailable` and, if
  there are other endpoints, the next call reconnects starting from the next one.
* Every gRPC failure surfaces as a `StoreError`; unreachable/timed-out endpoints (and rejected
  credentials) as its subclass `StoreUnavailable`, whose message names the endpoint, the
  operation and what gRPC reported, never the password. etcd's own "request timed out" is a
  `StoreUnavailable` too, but the request may still be applied: deleting a prefix (or revoking
  a lease) holding ~1M keys takes longer than etcd's request timeout and does complete.
* An auth token that etcd expired is renewed transparently (one reconnect and retry). Calls
  and watches running on a connection the store closes (failover, token renewal, `close()`)
  raise `StoreUnavailable`; watches end quietly on `close()`.
"""

from services.common.store.etcd.store import EtcdStore
from services.common.store.etcd.transactions import (
    MAX_TXN_BYTES,
    MAX_TXN_OPS,
    plan_transactions,
    prefix_range_end,
)

__all__ = ["MAX_TXN_BYTES", "MAX_TXN_OPS", "EtcdStore", "plan_transactions", "prefix_range_end"]
