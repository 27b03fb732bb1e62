"""The admin RPCs: GetSession, GetPolicy, SetPolicy, Explain and GetLeader. Reads answer on
any Conductor (a standby is warm); SetPolicy only on the serving leader, recorded in etcd."""

from __future__ import annotations

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.policies import POLICIES
from kvsched.core.requests import RequestError
from services.common.store.interface import Put, StoreError
from services.conductor import keys, placement_messages
from services.conductor.explain import Explainer
from services.conductor.fencing import TermWriter
from services.conductor.leadership import Leadership
from services.conductor.rpc_status import Context, abort, etcd_away, require_leader
from services.conductor.term import CurrentTerm


class AdminRpcs:
    """Handlers of the admin RPCs."""

    def __init__(
        self,
        current: CurrentTerm,
        leadership: Leadership,
        writer: TermWriter,
        explainer: Explainer,
    ) -> None:
        self.current = current
        self.leadership = leadership
        self.writer = writer
        self.explainer = explainer

    async def GetSession(
        self, request: pb.GetSessionRequest, context: Context
    ) -> pb.GetSessionResponse:
        state = self.current().state
        try:
            session = state.session(request.session_id)
        except RequestError as exc:
            await abort(context, exc)
        return pb.GetSessionResponse(session=placement_messages.session_message(state, session))

    async def GetPolicy(
        self, request: pb.GetPolicyRequest, context: Context
    ) -> pb.GetPolicyResponse:
        scheduler = self.current().state.scheduler
        return pb.GetPolicyResponse(
            spec=scheduler.spec,
            params={k: str(v) for k, v in scheduler.policy.params.items()},
            available=sorted(POLICIES),
        )

    async def SetPolicy(
        self, request: pb.SetPolicyRequest, context: Context
    ) -> pb.SetPolicyResponse:
        await require_leader(self.leadership, context)
        spec = request.spec.strip()
        try:
            previous = self.current().state.set_policy(spec)
        except RequestError as exc:
            await abort(context, exc)
        try:
            await self.writer.commit([Put(keys.POLICY.encode(), spec.encode())])
        except StoreError as exc:
            self.current().state.set_policy(previous)  # not recorded: not changed
            await etcd_away(context, "etcd did not take the policy", exc)
        return pb.SetPolicyResponse(previous_spec=previous, spec=spec)

    async def Explain(self, request: pb.ExplainRequest, context: Context) -> pb.ExplainResponse:
        try:
            decision = self.explainer.explain(request)
        except RequestError as exc:
            await abort(context, exc)
        return pb.ExplainResponse(
            decision=placement_messages.decision_message(
                self.current().state, decision, explain=True
            ),
            rejected=decision.rejected,
        )

    async def GetLeader(
        self, request: pb.GetLeaderRequest, context: Context
    ) -> pb.GetLeaderResponse:
        leadership = self.leadership
        leader = leadership.leader
        return pb.GetLeaderResponse(
            self_id=leadership.self_id,
            is_leader=leadership.serving,
            leader_id=leader.id if leader else "",
            leader_url=leader.url if leader else "",
            leader_http_url=leader.http_url if leader else "",
        )
