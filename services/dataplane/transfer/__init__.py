"""The bytes of KV transfers: a region per engine file (`region`), the runs a read moves
(`runs`), the backend interface (`backend`) and its two implementations, `tcp` (our own
asyncio TCP: `tcp_server`, `tcp_reader`, `tcp_wire`, `sockio`) and `mooncake`
(mooncake-transfer-engine), chosen by `factory.open_backend`.

The package itself imports none of them (import the module that owns a name): its modules
import one another, and a package that imported them back would close a circle."""
