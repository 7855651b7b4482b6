"""The daemon's gRPC edge: servicer, validation, status codes, interceptors.

    servicer.py    Servicer (kvstore.v1.KVStore on a Store), generic_handler
    validation.py  check_* of requests at the edge
    status.py      the table of status codes, `translated` and the request decoders
    auth.py        AuthInterceptor (tokens and roles) and Scope (a caller's tenant)
    metrics.py     MetricsInterceptor: each call timed and counted by status code

Outside this package only kvstore_server.main (which builds the server) imports grpc:
the token file and roles are kvstore_server.auth, the metrics registry and its HTTP
endpoint kvstore_server.metrics.
"""

from kvstore_server.rpc.servicer import Servicer, generic_handler

__all__ = ["Servicer", "generic_handler"]
