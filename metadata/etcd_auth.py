"""etcd's own credentials, derived from the cluster secret: who may read or write the metadata at all.

Every kvmesh process holding the cluster secret derives the same etcd user and
password (``etcd_password``); no credential file has to travel and nothing reaches
argv. ``enable_auth`` turns on etcd's authentication (user ``root`` with the root
role) on an etcd that kvmesh started itself (``kvmesh etcd``, the embedded etcd of
``serve`` / ``local-cluster`` / ``launch``); ``EtcdStore`` authenticates with them.
An etcd started elsewhere without authentication still works (values stay sealed,
``metadata/sealed_store.py``); its clients log once that it is open.
"""
from __future__ import annotations

import grpc

from kvmesh.auth import derive_key

ETCD_USER = "root"
AUTHENTICATE_TIMEOUT_S = 15.0  # etcd checks the password with bcrypt: slow on a loaded machine, once per client


def etcd_password(token: str) -> str:
    return derive_key(token, "kvmesh-etcd-v1", 24).hex()


def is_auth_disabled(error: BaseException) -> bool:
    """etcd's answer to an Authenticate call when it runs without authentication."""
    return isinstance(error, grpc.RpcError) and "authentication is not enabled" in str(error.details())


def is_token_rejected(error: BaseException) -> bool:
    """etcd refused a call for want of a (valid) auth token: authenticate again."""
    if not isinstance(error, grpc.RpcError):
        return False
    details = str(error.details())
    return "invalid auth token" in details or "user name is empty" in details


def authenticate(client, token: str, timeout_s: float) -> bool:
    """Authenticate ``client`` (a pyetcd client) with the credentials derived from ``token``.

    Returns False when etcd runs without authentication. The auth token travels as call metadata (gRPC
    refuses call credentials on a plaintext channel)."""
    from pyetcd.etcdrpc import rpc_pb2 as pb

    try:
        reply = client.authstub.Authenticate(pb.AuthenticateRequest(name=ETCD_USER, password=etcd_password(token)),
                                             max(timeout_s, AUTHENTICATE_TIMEOUT_S))
    except grpc.RpcError as e:
        if is_auth_disabled(e):
            return False
        raise
    client.metadata = (("token", reply.token),)
    client.call_credentials = None
    client._stubs.pop("watcher", None)  # the next watch opens its stream with the new token
    return True


def enable_auth(endpoint: str, token: str, timeout_s: float = 10.0) -> None:
    """Create the root user and role with the derived password and enable authentication (idempotent:
    an etcd that already has it, from an earlier start on the same data, is left as it is)."""
    import pyetcd
    from pyetcd.etcdrpc import rpc_pb2 as pb

    host, _, port = endpoint.rpartition(":")
    client = pyetcd.client(host=host, port=int(port), timeout=timeout_s)
    try:
        try:
            client.authstub.Authenticate(pb.AuthenticateRequest(name=ETCD_USER, password=etcd_password(token)),
                                         timeout_s)
            return  # enabled already, with our credentials
        except grpc.RpcError as e:
            if not is_auth_disabled(e):
                raise
        stub = client.authstub
        stub.RoleAdd(pb.AuthRoleAddRequest(name="root"), timeout_s)
        stub.UserAdd(pb.AuthUserAddRequest(name=ETCD_USER, password=etcd_password(token)), timeout_s)
        stub.UserGrantRole(pb.AuthUserGrantRoleRequest(user=ETCD_USER, role="root"), timeout_s)
        stub.AuthEnable(pb.AuthEnableRequest(), timeout_s)
    finally:
        client.close()
