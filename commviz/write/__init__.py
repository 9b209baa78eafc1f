"""Writing traces: Perfetto protobuf by hand (``proto`` wire format, ``pftrace`` tracks and
sequences), reading one back (``read``), and one merged Chrome JSON trace (``chrome``)."""
