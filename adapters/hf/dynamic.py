"""Transformers' models, modules and configs as the adapters see them.

Their attributes are each family's modeling file's own (``q_proj``, ``layer_idx``, ``num_key_value_heads``...),
which ``nn.Module.__getattr__`` types ``Tensor | Module`` and configs do not declare: functions that read a family's
fields take ``HFModule`` / ``HFConfig`` (checked at run time, with ``UnsupportedModelError`` naming what is
missing), and keep ``nn.Module`` / ``PreTrainedModel`` where they use the base classes' own API only.
"""

from typing import Any

#: a transformers ``nn.Module`` (model, decoder layer, attention module) read for its family's own attributes
HFModule = Any
#: a transformers ``PretrainedConfig`` read for its family's own fields
HFConfig = Any
