"""The service's rules for values, whatever moves them: the gRPC streams (``service/server.py``), the same-host
arena and the bulk data path (``service/bulk/``) all call this one core.

* ``limits.py``: ``ServerLimits``, the sizes, quotas and fairness settings of one server;
* ``tenancy.py``: keys and model fingerprints checked, keys scoped to their tenant;
* ``admission.py``: a put's in-flight budget and quota, held before its bytes are buffered;
* ``verify.py``: a received value verified as a block of its key, namespace and a known codec;
* ``commit.py``: a put's verified values stored (re-encodes bounded, exact sizes reserved);
* ``reads.py``: a get's values read a few ahead of what is sent, each key once;
* ``service.py``: ``ServiceCore``, the one object the transports hold.

Failures end the call through ``service.status.fail`` with a gRPC status code and message: the codes are the
service's error vocabulary on every transport (the data path sends them in its status frames).
"""
