"""The daemon's gRPC edge: servicer, validation, status codes.

    servicer.py    Servicer (kvstore.v1.KVStore on a Store), generic_handler
    validation.py  check_* of requests at the edge
    status.py      the table of status codes, `translated` and the request decoders

Authentication stays in kvstore_server.auth.
"""

from kvstore_server.rpc.servicer import Servicer, generic_handler

__all__ = ["Servicer", "generic_handler"]
