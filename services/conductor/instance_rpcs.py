"""The instance RPCs: RegisterInstance, KeepAliveInstance, DeregisterInstance and
ListInstances, over the `Registrar`. KeepAliveInstance is answered by a standby too (it
renews the lease in etcd), so instance leases do not depend on the leader being up."""

from __future__ import annotations

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.requests import RequestError
from services.common.serving import durations
from services.common.store.interface import StoreError
from services.conductor import instance_messages
from services.conductor.leadership import Leadership
from services.conductor.node_access import require_instance_node, require_node
from services.conductor.registration import Registrar
from services.conductor.rpc_status import Context, abort, etcd_away, require_leader
from services.conductor.term import CurrentTerm


class InstanceRpcs:
    """Handlers of the instance RPCs; writes only on the serving leader, lease renewals
    anywhere, and a Messenger's only for its own node's instances (`node_access`)."""

    def __init__(self, registrar: Registrar, current: CurrentTerm, leadership: Leadership) -> None:
        self.registrar = registrar
        self.current = current
        self.leadership = leadership

    async def RegisterInstance(
        self, request: pb.RegisterInstanceRequest, context: Context
    ) -> pb.RegisterInstanceResponse:
        await require_leader(self.leadership, context)
        # The node it claims, and the one it is registered on (no taking over another's).
        await require_node(context, request.spec.node, f"instance {request.spec.instance_id!r}")
        await require_instance_node(context, self.current().state, request.spec.instance_id)
        try:
            spec = instance_messages.instance_spec(request.spec)
            lease = await self.registrar.register(spec, durations.seconds(request.lease_ttl))
        except RequestError as exc:
            await abort(context, exc)
        except StoreError as exc:
            await etcd_away(context, "etcd is unavailable", exc)
        return pb.RegisterInstanceResponse(
            instance=instance_messages.instance_status(self.current().state, spec.instance_id),
            lease_ttl=durations.duration(lease.ttl_s),
        )

    async def KeepAliveInstance(
        self, request: pb.KeepAliveInstanceRequest, context: Context
    ) -> pb.KeepAliveInstanceResponse:
        await require_instance_node(context, self.current().state, request.instance_id)
        if self.leadership.is_leader and not self.leadership.serving:
            # Elected and catching up: the cursor it would answer may not count the mirrored
            # batches it is about to apply; the caller asks again (or another Conductor).
            await require_leader(self.leadership, context)
        try:
            if self.leadership.serving:
                inst, remaining = await self.registrar.keep_alive(request.instance_id)
            else:
                inst, remaining = await self.registrar.renew(request.instance_id)
        except RequestError as exc:
            if exc.kind == "unavailable":  # a standby that does not know it: ask the leader
                await require_leader(self.leadership, context)
            await abort(context, exc)
        except StoreError as exc:
            await etcd_away(context, "etcd is unavailable", exc)
        return pb.KeepAliveInstanceResponse(
            lease_ttl=durations.duration(remaining), next_event_sequence=inst.next_sequence
        )

    async def DeregisterInstance(
        self, request: pb.DeregisterInstanceRequest, context: Context
    ) -> pb.DeregisterInstanceResponse:
        await require_leader(self.leadership, context)
        await require_instance_node(context, self.current().state, request.instance_id)
        try:
            unbound = await self.registrar.deregister(request.instance_id)
        except RequestError as exc:
            await abort(context, exc)
        except StoreError as exc:
            await etcd_away(context, "etcd is unavailable", exc)
        return pb.DeregisterInstanceResponse(sessions_unbound=unbound)

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: Context
    ) -> pb.ListInstancesResponse:
        state = self.current().state
        ordered = sorted(state.instances, key=lambda iid: state.instances[iid].slot)
        return pb.ListInstancesResponse(
            instances=[instance_messages.instance_status(state, iid) for iid in ordered]
        )
