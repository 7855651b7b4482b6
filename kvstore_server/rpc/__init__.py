"""The daemon's gRPC edge: servicer, validation, status codes.

    servicer.py    Servicer (kvstore.v1.KVStore on a Store), generic_handler, SERVICE_NAME
    validation.py  check_* of requests at the edge
    status.py      the table of status codes, `translated` and the request decoders

Authentication stays in kvstore_server.auth.
"""

from kvstore_server.rpc.servicer import SERVICE_NAME, Servicer, generic_handler

__all__ = ["SERVICE_NAME", "Servicer", "generic_handler"]
