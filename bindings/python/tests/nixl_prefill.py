"""The prefill process of test_nixl.py: its own NIXL agent and host pages, driven by decode
over stdin/stdout (the side channel: one JSON object a line, bytes in hex).

Out of band first: it prints {"metadata", "layout"} and reads decode's. Then, per pull
{"request", "tenant", "prompt", "dest": [[page, generation]], "direction", "fault"} it prefills
the prompt's KV into its own pages, builds the manifest for decode's pages and pushes (direction
"write") or stages (direction "read") it, injecting `fault`; it answers {"done": fault} when
its side is over. Direction "write-building" lets kvguard build the manifest on the way,
"write-ahead" too, with the pages checksummed before the faults. {"quit": true} ends it.

Faults beyond the demo's: "extra-page" pushes one more page into decode's page `victim` (a page
decode did not offer) and names it in the notice; "swap-page" pushes its first page into
`victim` instead of the first offered page, and names it so; "retry-late" holds the first pull of a request
back unanswered ({"done": "held"}) and, when decode pulls it again, stages the held attempt
first (late, in pages of its own), then the retry. "push-late" holds a push back ({"done":
"held"}) until decode sends {"late": request}, then pushes it (after decode gave up on it).
"flood" first sends FLOOD notices carrying 64 KiB each for requests decode never asked for
(`stage`s that time out), then transfers as asked.
"""

import json
import sys
import zlib

import kvguard

PAGES = 16
PAGE_SIZE = 4
SLOT_BYTES = 16
PAGE_BYTES = PAGE_SIZE * SLOT_BYTES
SENDER = 1
DUMMY_TOKEN = 0
FLOOD = 8
FIRST_SRC_PAGE = 3  # prefill's own pages are elsewhere in its pool than decode's
# The manifest wire format (src/transfer/wire.rs): a 64-byte header, 16 bytes a page (the
# page's CRC32 at 12), a CRC32 of everything before as the trailer.
HEADER_LEN, PAGE_ENTRY_LEN, CRC_AT = 64, 16, 12


def kv_pages(prompt):
    """The prompt's KV: each slot's bytes derived from its token."""
    pages = [prompt[i : i + PAGE_SIZE] for i in range(0, len(prompt), PAGE_SIZE)]
    return [b"".join(bytes([t % 251]) * SLOT_BYTES for t in page) for page in pages]


def manifest_for(request, tenant, prompt, dest, pages):
    return kvguard.Manifest.build(request, tenant, SENDER, PAGE_SIZE, SLOT_BYTES, prompt, dest, pages).encode()


def without_first_checksum(manifest):
    """The manifest with page 0's CRC zeroed and the seal recomputed: a sender that skipped it."""
    m = bytearray(manifest)
    at = HEADER_LEN + CRC_AT
    m[at : at + 4] = bytes(4)
    m[-4:] = zlib.crc32(bytes(m[:-4])).to_bytes(4, "little")
    return bytes(m)


def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "prefill"
    agent = kvguard.NixlAgent(name)
    region = kvguard.HostRegion(agent, PAGES, PAGE_BYTES)
    send({"metadata": agent.metadata().hex(), "layout": region.layout().hex()})
    peer = json.loads(sys.stdin.readline())
    # Parts of one page: a two-page push goes as two WRITEs, checksums overlapped.
    link = kvguard.NixlLink(
        agent, bytes.fromhex(peer["metadata"]), bytes.fromhex(peer["layout"]), part_bytes=PAGE_BYTES
    )
    held_back = {}  # request -> (manifest, pages): the `late` fault's transfer
    late_pushes = {}  # request -> (src, dest pages, manifest): the `push-late` fault's push
    for line in sys.stdin:
        pull = json.loads(line)
        if pull.get("quit"):
            return
        if "late" in pull:
            src, dest_pages, manifest = late_pushes.pop(pull["late"])
            link.push(region, src, dest_pages, pull["late"], manifest)
            send({"done": "pushed-late"})
            continue
        request, tenant, fault = pull["request"], pull["tenant"], pull["fault"]
        prompt = [DUMMY_TOKEN] if fault == "dummy-prompt" else pull["prompt"]
        dest = [kvguard.PageRef(p, g) for p, g in pull["dest"]]
        pages = kv_pages(prompt)
        dest = dest[: len(pages)]
        manifest_request = request + 1000 if fault == "wrong-request" else request
        manifest = manifest_for(manifest_request, tenant, prompt, dest, pages)
        if fault == "missing-checksum":
            manifest = without_first_checksum(manifest)
        if fault == "late":
            if request not in held_back:
                # Not ready: decline, and keep the transfer made for these incarnations.
                held_back[request] = (manifest, pages, dest)
                link.decline(request)
                send({"done": "declined"})
                continue
            manifest, pages, _ = held_back.pop(request)
        if fault == "flood":
            for i in range(FLOOD):
                try:
                    link.stage([], request + 10_000 + i, bytes(64 << 10), timeout=0.05)
                except kvguard.NixlError:
                    pass  # decode never answers a request it did not ask for
        if fault == "silent":
            send({"done": fault})  # no transfer, no notification
            continue
        if fault == "retry-late":
            if request not in held_back:
                held_back[request] = (manifest, pages, dest)
                send({"done": "held"})
                continue
            late_manifest, late_pages, _ = held_back.pop(request)
            late_src = []
            for i, data in enumerate(late_pages):
                page = FIRST_SRC_PAGE + 6 + i
                region.write(page, data)
                late_src.append((page, len(data)))
            # Returns once decode released these pages: its answer to the abandoned pull.
            link.stage(late_src, request, late_manifest)
        src = []
        for i, data in enumerate(pages):
            page = FIRST_SRC_PAGE + i
            region.write(page, data)
            src.append((page, len(data)))
        # Checksummed ahead (as while waiting for decode's offer): before any fault below.
        ahead = [region.checksum(page, length) for page, length in src]
        if fault == "flip-byte":
            first = bytearray(region.read(FIRST_SRC_PAGE))
            first[5] ^= 0x01
            region.write(FIRST_SRC_PAGE, bytes(first))
        if fault == "truncate-page":
            src[0] = (src[0][0], src[0][1] - SLOT_BYTES)
        if pull["direction"] == "write-building":
            # The manifest built by kvguard on the way (push_prompt), for the faults that do not
            # tamper with it or the bytes after it is made.
            try:
                link.push_prompt(region, src, dest, request, tenant, SENDER, PAGE_SIZE, SLOT_BYTES, prompt)
            except kvguard.NixlError:
                pass  # refused before anything was sent: decode's wait times out
        elif pull["direction"] == "write-ahead":
            # The pages checksummed ahead, the manifest built by kvguard (push_prompt's `ahead`).
            try:
                link.push_prompt(
                    region, src, dest, request, tenant, SENDER, PAGE_SIZE, SLOT_BYTES, prompt, ahead=ahead
                )
            except kvguard.NixlError:
                pass  # refused before anything was sent: decode's wait times out
        elif pull["direction"] == "write" and fault == "push-late":
            late_pushes[request] = (src, [r.page for r in dest], manifest)
            send({"done": "held"})
            continue
        elif pull["direction"] == "write":
            dest_pages = [r.page for r in dest]
            if fault == "extra-page":
                # One more WRITE target than decode offered: another request's page.
                src.append((FIRST_SRC_PAGE + len(src), PAGE_BYTES))
                dest_pages.append(pull["victim"])
            if fault == "swap-page":
                dest_pages[0] = pull["victim"]
            link.push(region, src, dest_pages, request, manifest)
        else:
            link.stage(src, request, manifest)
        send({"done": fault})


if __name__ == "__main__":
    main()
