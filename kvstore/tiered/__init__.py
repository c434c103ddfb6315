"""The layers ``kvstore.store.TieredStore`` composes, after vLLM v1's cache manager over its block pool:

* ``codecs``: each tier's codec (``TierSpec``): encoding a put, re-encoding a value for another tier, decode bounds;
* ``decode``: decoding many values, large ones on a few threads;
* ``meter``: counters, events and outage logging, a metrics layer any store reports to (llm-d's instrumented index);
* ``pins``: the pinned keys, kept to the blocks some tier holds;
* ``stack``: the tier stack: write policy, write-down on eviction, promotion, prefix lookups, deletes;
* ``reads``: read-through over the stack: the first tier holding each key, damaged and foreign values as misses;
* ``device``: the GPU tier (``kvstore.device_tier``) as a layer above the stack.
"""
