"""The one sealed-msgpack primitive and the two codecs built on it: each channel's domain
tag keeps its messages from verifying on the other, even under the same key."""

from __future__ import annotations

import hmac

import msgpack
import pytest

from transport import sealed, wire
from transport.base import TransferAuthError, TransferCorrupt, TransferRejected
from transport.sealed import BadMac, Malformed, SealedCodec, TooLarge, UnpackLimits
from transport.wire import LAYER, Header, WireCodec, WireLimits
from workers.stream import wire as stream_wire
from workers.stream.wire import PING, StreamAuthError, StreamCodec, StreamRejected

KEY = b"sealed-test-key-0123456789abcdef"
LIMITS = UnpackLimits(max_bytes=1 << 10, max_str_len=64, max_array_len=8, max_map_len=8)


def test_seal_and_open_round_trip():
    codec = SealedCodec(KEY, b"test-a\0", LIMITS)
    body, mac = codec.seal({"t": "x", "n": [1, 2, 3]})
    assert len(mac) == sealed.MAC_LEN
    assert codec.open(body, mac) == {"t": "x", "n": [1, 2, 3]}


def test_the_same_key_under_another_domain_never_verifies():
    a, b = SealedCodec(KEY, b"test-a\0", LIMITS), SealedCodec(KEY, b"test-b\0", LIMITS)
    body, mac = a.seal({"t": "x"})
    with pytest.raises(BadMac):
        b.open(body, mac)
    # nor with the domain moved into the body: tags are prefix-free
    with pytest.raises(BadMac):
        SealedCodec(KEY, b"test\0", LIMITS).open(b"-a\0" + body, mac)


def test_stream_message_is_refused_by_the_kv_header_codec_and_back():
    stream, kv = StreamCodec(KEY), WireCodec(KEY)
    assert stream_wire.DOMAIN != wire.DOMAIN
    body, mac = stream.seal({"t": PING})
    with pytest.raises(TransferAuthError) as refused:
        kv.open(body, mac)
    assert refused.value.reason == "bad_mac"
    with pytest.raises(TransferAuthError):  # nor with the stream's tag glued onto the body
        kv.open(stream_wire.DOMAIN + body, mac)
    header = kv.seal(Header(LAYER, "t1"))
    with pytest.raises(StreamAuthError):
        stream.open(header)
    with pytest.raises(StreamAuthError):
        stream.open([wire.DOMAIN + header[0], header[1]])
    # each still opens its own
    assert stream.open([body, mac])["t"] == PING
    assert kv.open(*header).transfer_id == "t1"


def test_size_is_checked_before_the_mac_and_the_mac_before_parsing():
    codec = SealedCodec(KEY, b"test-a\0", LIMITS)
    with pytest.raises(TooLarge):
        codec.open(b"\x00" * (LIMITS.max_bytes + 1), b"not a mac")
    with pytest.raises(BadMac):
        codec.open(b"\xc1 not msgpack", bytes(sealed.MAC_LEN))
    body, mac = codec.seal({"t": "x"})
    with pytest.raises(BadMac):
        codec.open(body, mac[:-1])  # truncated
    with pytest.raises(Malformed):  # authentic, but not a map
        codec.open(*codec.seal([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(Malformed):  # authentic, but past the parser's limits
        codec.open(*codec.seal({"s": "x" * (LIMITS.max_str_len + 1)}))


def test_the_mac_is_compared_in_constant_time(monkeypatch):
    calls, compare = [], hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(sealed.hmac, "compare_digest", spy)
    codec = SealedCodec(KEY, b"test-a\0", LIMITS)
    body, mac = codec.seal({"t": "x"})
    codec.open(body, mac)
    with pytest.raises(BadMac):
        codec.open(body, bytes(sealed.MAC_LEN))
    assert len(calls) == 2


def test_binary_and_extension_types_are_refused():
    codec = SealedCodec(KEY, b"test-a\0", LIMITS)
    for value in (b"raw bytes", msgpack.ExtType(1, b"x")):
        body = msgpack.packb({"v": value}, use_bin_type=True)
        with pytest.raises(Malformed):
            codec.open(body, codec.mac(body))


@pytest.mark.parametrize("domain", [b"", b"\0", b"no-terminator", b"two\0nuls\0"])
def test_domain_tags_must_be_prefix_free(domain):
    with pytest.raises(ValueError):
        SealedCodec(KEY, domain, LIMITS)


def test_short_keys_are_refused_and_never_shown():
    for make in (lambda k: SealedCodec(k, b"test-a\0", LIMITS), WireCodec, StreamCodec):
        with pytest.raises(ValueError):
            make(b"short")
        assert KEY.decode() not in repr(make(KEY))


def test_codecs_map_refusals_to_their_own_errors():
    kv = WireCodec(KEY, WireLimits(max_header_bytes=256))
    with pytest.raises(TransferRejected) as big:
        kv.open(b"\x00" * 257, bytes(sealed.MAC_LEN))
    assert big.value.reason == "bounds"
    body = msgpack.packb([1, 2, 3])
    with pytest.raises(TransferCorrupt) as bad:
        kv.open(body, SealedCodec(KEY, wire.DOMAIN, LIMITS).mac(body))
    assert bad.value.reason == "malformed"
    stream = StreamCodec(KEY)
    with pytest.raises(StreamRejected):
        stream.open(stream.seal([1, 2, 3]))  # type: ignore[arg-type]
