"""Protobuf wire format for the few Perfetto messages commviz writes, encoded by hand.

A Perfetto trace is ``repeated TracePacket packet = 1``: each packet is ``0x0A``, its length as
a varint, and its bytes, so packets can be appended to a file (or files concatenated) one by
one. Hand encoding avoids building a protobuf object per event, which is what makes the
perfetto package's builder slow; the field numbers below are those of ``perfetto_trace_pb2``
(perfetto 0.59.1) and tests round-trip every message through that parser.
"""

from __future__ import annotations


VARINT, FIXED64, LEN = 0, 1, 2
_U64 = (1 << 64) - 1


def _encode_varint(value: int) -> bytes:
    value &= _U64                       # negative int64 -> two's complement, 10 bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


SMALL = tuple(_encode_varint(i) for i in range(1 << 14))   # varints below 16384, precomputed
# the low 14 bits of a bigger value: two 7-bit groups, both with the continuation bit set
LOW14 = tuple(bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(1 << 14))


def varint(value: int) -> bytes:
    if 0 <= value < 16384:
        return SMALL[value]
    if 0 < value < 1 << 28:
        return LOW14[value & 0x3FFF] + SMALL[value >> 14]
    return _encode_varint(value)


def read_varint(buf: bytes, pos: int) -> tuple[int, int] | None:
    """(value, next position), or None if ``buf`` ends inside the varint."""
    result = shift = 0
    n = len(buf)
    while pos < n:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
    return None


def tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def f_varint(field: int, value: int) -> bytes:
    return tag(field, VARINT) + varint(value)


def f_bytes(field: int, data: bytes) -> bytes:
    return tag(field, LEN) + varint(len(data)) + data


def f_str(field: int, text: str) -> bytes:
    return f_bytes(field, text.encode("utf-8", "surrogatepass"))


def packet(body: bytes) -> bytes:
    """One ``Trace.packet`` entry."""
    return b"\x0a" + varint(len(body)) + body


class F:
    """Field numbers (perfetto_trace_pb2)."""

    # TracePacket
    CLOCK_SNAPSHOT, TIMESTAMP, SEQ_ID, TRACK_EVENT, INTERNED, FLAGS = 6, 8, 10, 11, 12, 13
    CLOCK_ID, DEFAULTS, TRACK_DESCRIPTOR = 58, 59, 60
    # TrackEvent
    CATEGORY_IIDS, ANNOTATIONS, TYPE, NAME_IID, DOUBLE_COUNTER_VALUE, FLOW_IDS = 3, 4, 9, 10, 44, 47
    # DebugAnnotation
    A_NAME_IID, A_BOOL, A_INT, A_DOUBLE, A_STRING, A_STRING_IID = 1, 2, 4, 5, 6, 17
    # InternedData
    I_CATEGORIES, I_NAMES, I_ANNOTATION_NAMES, I_STRINGS = 1, 2, 3, 29
    # TrackDescriptor
    D_UUID, D_NAME, D_PROCESS, D_PARENT, D_COUNTER, D_CHILD_ORDERING = 1, 2, 3, 5, 8, 11
    D_ORDER_RANK, D_DESCRIPTION, D_MERGE_BEHAVIOR, D_MERGE_KEY = 12, 14, 15, 16
    D_PROCESS_ORDERING = 19
    # ProcessDescriptor
    P_PID, P_NAME, P_LABELS = 1, 6, 8
    # CounterDescriptor
    C_UNIT, C_UNIT_NAME, C_Y_AXIS_SHARE_KEY = 3, 6, 7
    # ClockSnapshot / Clock
    CS_CLOCKS, CL_ID, CL_TIMESTAMP, CL_INCREMENTAL = 1, 1, 2, 3
    # TracePacketDefaults / TrackEventDefaults
    PD_CLOCK_ID, PD_TRACK_EVENT_DEFAULTS, TD_TRACK_UUID = 58, 11, 11


# enum values
SLICE_BEGIN, SLICE_END, INSTANT, COUNTER = 1, 2, 3, 4
SEQ_CLEARED, SEQ_NEEDS = 1, 2
CLOCK_BOOTTIME = 6
CLOCK_INCREMENTAL = 64               # sequence-scoped clock id: delta-encoded ns, as the SDK does
ORDER_EXPLICIT = 3                   # ChildTracksOrdering.EXPLICIT
PROCESS_ORDERING_EXPLICIT = 1
MERGE_BY_KEY = 3                     # SiblingMergeBehavior.BY_SIBLING_MERGE_KEY
UNIT_COUNT = 2
