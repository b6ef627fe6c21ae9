"""protolearn: train one language model together over the internet.

The subpackages follow the design card: ``protocol`` (wire protocol, pure core plus one libp2p
adapter), ``stages`` (the model split into pipeline stages, data, the reference trainer),
``coordinator`` (membership and step accounting) and ``node`` (a volunteer node). ``cli`` is the
thin command-line layer on top.
"""

__version__ = "0.1.0"
