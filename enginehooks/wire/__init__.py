"""The wire between the trainer and the workers, on a floor of its own: every message
both sides exchange is built and parsed here (a test scans the library for it), and
nothing here imports `control/`, `engine/` or an engine's extension.

Every channel (vLLM's `/collective_rpc` and `collective_rpc`, SGLang's scheduler RPC,
Ray actors, in-process replicas) carries the same messages:

- `envelopes.py`: the call id on every RPC, the Ok/Err envelope, errors restored as
  their own class, and errors relayed as text;
- `payloads.py`: what each verb's token signs (`signed_payload`, `token`,
  `verify_token`), and the leave that names its group;
- `routes.py`: the signed HTTP control routes and a server's identity;
- `requests.py`: a typed request per verb, decoded once at the boundary, and the join's
  world-size check;
- `replies.py`: the typed replies (`WorkerInfo`, `JoinReply`, ...);
- `endpoint.py`: a transport group's endpoint, typed;
- `groups.py`: what the `update_group` hook is asked (one typed request per mode).

This module re-exports the public names of all of them (`from enginehooks import wire`).
"""

from enginehooks.wire.endpoint import GroupEndpoint as GroupEndpoint
from enginehooks.wire.endpoint import group_id as group_id
from enginehooks.wire.envelopes import (
    CALL_PREFIX as CALL_PREFIX,
)
from enginehooks.wire.envelopes import (
    RELAY_MARK as RELAY_MARK,
)
from enginehooks.wire.envelopes import (
    VERSION as VERSION,
)
from enginehooks.wire.envelopes import (
    RelayedError as RelayedError,
)
from enginehooks.wire.envelopes import (
    StaleReply as StaleReply,
)
from enginehooks.wire.envelopes import (
    answers as answers,
)
from enginehooks.wire.envelopes import (
    call_arg as call_arg,
)
from enginehooks.wire.envelopes import (
    err as err,
)
from enginehooks.wire.envelopes import (
    error_classes as error_classes,
)
from enginehooks.wire.envelopes import (
    error_reply as error_reply,
)
from enginehooks.wire.envelopes import (
    is_envelope as is_envelope,
)
from enginehooks.wire.envelopes import (
    new_call_id as new_call_id,
)
from enginehooks.wire.envelopes import (
    ok as ok,
)
from enginehooks.wire.envelopes import (
    read_reply as read_reply,
)
from enginehooks.wire.envelopes import (
    relay_text as relay_text,
)
from enginehooks.wire.envelopes import (
    relayed as relayed,
)
from enginehooks.wire.envelopes import (
    relayed_envelope as relayed_envelope,
)
from enginehooks.wire.envelopes import (
    relayed_error as relayed_error,
)
from enginehooks.wire.envelopes import (
    restore_error as restore_error,
)
from enginehooks.wire.envelopes import (
    result_reply as result_reply,
)
from enginehooks.wire.envelopes import (
    split_call as split_call,
)
from enginehooks.wire.envelopes import (
    unwrap as unwrap,
)
from enginehooks.wire.payloads import (
    leave_message as leave_message,
)
from enginehooks.wire.payloads import (
    parse_leave as parse_leave,
)
from enginehooks.wire.payloads import (
    signed_payload as signed_payload,
)
from enginehooks.wire.payloads import (
    token as token,
)
from enginehooks.wire.payloads import (
    verify_token as verify_token,
)
from enginehooks.wire.replies import (
    FlushReply as FlushReply,
)
from enginehooks.wire.replies import (
    JoinReply as JoinReply,
)
from enginehooks.wire.replies import (
    LeaveReply as LeaveReply,
)
from enginehooks.wire.replies import (
    ReceiveReply as ReceiveReply,
)
from enginehooks.wire.replies import (
    WorkerInfo as WorkerInfo,
)
from enginehooks.wire.replies import (
    check_infos as check_infos,
)
from enginehooks.wire.requests import (
    REQUESTS as REQUESTS,
)
from enginehooks.wire.requests import (
    WORLD_FIX as WORLD_FIX,
)
from enginehooks.wire.requests import (
    CheckRequest as CheckRequest,
)
from enginehooks.wire.requests import (
    DigestsRequest as DigestsRequest,
)
from enginehooks.wire.requests import (
    FlushRequest as FlushRequest,
)
from enginehooks.wire.requests import (
    InfoRequest as InfoRequest,
)
from enginehooks.wire.requests import (
    JoinRequest as JoinRequest,
)
from enginehooks.wire.requests import (
    LeaveRequest as LeaveRequest,
)
from enginehooks.wire.requests import (
    ReceiveRequest as ReceiveRequest,
)
from enginehooks.wire.requests import (
    Request as Request,
)
from enginehooks.wire.requests import (
    check_world as check_world,
)
from enginehooks.wire.routes import (
    IDENTITY_ROUTE as IDENTITY_ROUTE,
)
from enginehooks.wire.routes import (
    ROUTE_AUTH_HEADER as ROUTE_AUTH_HEADER,
)
from enginehooks.wire.routes import (
    ROUTE_VERB as ROUTE_VERB,
)
from enginehooks.wire.routes import (
    identity_answer as identity_answer,
)
from enginehooks.wire.routes import (
    read_identity as read_identity,
)
from enginehooks.wire.routes import (
    route_headers as route_headers,
)
from enginehooks.wire.routes import (
    route_payload as route_payload,
)
from enginehooks.wire.routes import (
    server_verifier as server_verifier,
)
from enginehooks.wire.routes import (
    verify_route as verify_route,
)
