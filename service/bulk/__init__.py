"""The bulk data path beside gRPC: the values of a get or put over a separate TCP connection (TLS when the server
has TLS), gRPC staying the control plane (auth, quotas, fairness, lookups, events).

gRPC Python copies every byte of a message into its own slices and back into a ``bytes`` on each side; a plain
socket moves the same values with ``recv_into`` into preallocated buffers and scatter-gather sends. So a transfer is:

1. ``OpenDataPath`` over the authenticated channel (``handler.py``): the server checks the request as ``GetBlocks``
   or ``PutBlocks`` would (namespace, keys, and for a put the sizes against the limits and the quota, reserved now)
   and answers a one-time ticket bound to the namespace, the op and the keys (``ticket.py``) and its data port;
2. the client connects to that port on the host it reached the server at and sends a hello carrying the ticket
   (``framing.py``); the listener (``listener.py``) verifies it and hands the connection to the waiting call;
3. the values move (``transport.py``): a put's values are checked and verified as they arrive and stored only when
   all arrived whole; a get's values go out as stored, each checked by the client before it is handed on;
4. the call ends with the transfer's outcome, and a failure also reaches the data connection as a status frame.

``client.py`` is ``RemoteStore``'s side; it falls back to gRPC when the server has no data path, its port cannot
be reached or takes no hello, or it refuses the connection before reading it.
"""
