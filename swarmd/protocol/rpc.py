"""The trio <-> gRPC transport; this module is its public face, the ``_rpc_*`` modules its parts.

gRPC's sync server runs handlers on a bounded thread pool; each handler hops into the daemon's
trio loop, where the application's async handler runs under a cancel scope whose deadline is the
client's, and which the client's cancellation cancels. The client side issues ``.future`` calls
and awaits them from trio, cancelling the call when the awaiting scope is cancelled, so a trio
timeout on one peer becomes a cancelled handler on the other.

Why not grpc.aio: it wants asyncio's loop, and the daemon is one trio run. Bridging two event
loops costs more than handing each call to a worker thread that gRPC's C core already has.

Requests are authenticated by a signed header in the metadata (see identity.py); the server
verifies it in the gRPC thread, before trio or the application sees the request.

Tensors travel as frame streams (see framing.py) with identity serialisers: the bytes gRPC hands
us are the frames themselves, so nothing is copied more than once on either end.

The transport (this module and ``_rpc_*``) is the only code in swarmd that imports ``grpc``.
Callers import from here (``from swarmd.protocol import rpc``), never from the parts:

- ``_rpc_config``: TransportConfig, the limits shared by both ends;
- ``_rpc_service``: Service, Method and its kinds, method paths, the transport's own service;
- ``_rpc_server``: RpcServer and ``serve``, gRPC threads handing calls to trio;
- ``_rpc_client``: RpcClient, calls awaited from trio over gRPC or the bulk data plane.
"""

from __future__ import annotations

from swarmd.protocol._pacing import paced as paced
from swarmd.protocol._rate_limit import RateLimiter as RateLimiter
from swarmd.protocol._rate_limit import RateLimits as RateLimits
from swarmd.protocol._rpc_client import BULK_INFO_TIMEOUT_S as BULK_INFO_TIMEOUT_S
from swarmd.protocol._rpc_client import BULK_INFO_TTL_S as BULK_INFO_TTL_S
from swarmd.protocol._rpc_client import BULK_RETRY_S as BULK_RETRY_S
from swarmd.protocol._rpc_client import RpcClient as RpcClient
from swarmd.protocol._rpc_config import TransportConfig as TransportConfig
from swarmd.protocol._rpc_server import RpcServer as RpcServer
from swarmd.protocol._rpc_server import serve as serve
from swarmd.protocol._rpc_service import GET_BULK_INFO as GET_BULK_INFO
from swarmd.protocol._rpc_service import TRANSPORT_SERVICE as TRANSPORT_SERVICE
from swarmd.protocol._rpc_service import Gate as Gate
from swarmd.protocol._rpc_service import Method as Method
from swarmd.protocol._rpc_service import Service as Service
from swarmd.protocol._rpc_service import TensorAdmit as TensorAdmit
from swarmd.protocol._rpc_service import TensorInHandler as TensorInHandler
from swarmd.protocol._rpc_service import TensorOutHandler as TensorOutHandler
from swarmd.protocol._rpc_service import UnaryHandler as UnaryHandler
from swarmd.protocol._rpc_service import method_path as method_path
from swarmd.protocol._rpc_service import tensor_in as tensor_in
from swarmd.protocol._rpc_service import tensor_out as tensor_out
from swarmd.protocol._rpc_service import unary as unary
from swarmd.protocol.calls import CallContext as CallContext
from swarmd.protocol.calls import RpcError as RpcError
from swarmd.protocol.calls import RpcObserver as RpcObserver
from swarmd.protocol.calls import StatusCode as StatusCode
from swarmd.protocol.calls import TensorCaller as TensorCaller
from swarmd.protocol.calls import UnaryCaller as UnaryCaller
from swarmd.protocol.calls import rate_limited as rate_limited
