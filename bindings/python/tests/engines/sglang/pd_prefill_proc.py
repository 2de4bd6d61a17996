"""The prefill server of a two-process PD test (test_pd_net.py): SGLang's own prefill scheduler
(pd_rig.py), kvguard attached as its plugin attaches it, its channel from
``KVGUARD_SGLANG_PD_CHANNEL`` (the test's decode process connects to it). Runs the workload's
prefill side until the file ``<wire>/stop`` appears, then prints what it saw as one JSON line.

    python pd_prefill_proc.py WIRE_DIR N
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # as conftest.py sets it


def main(wire: str, n: int) -> None:
    import json

    import pd_rig
    from scheduler_rig import attach_kvguard, pool_pages
    from test_pd_schedulers import CONTEXT, workload

    pd_rig.install_wire(wire)
    prefill = pd_rig.build_prefill(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, chunked_prefill_size=48)
    attach_kvguard(prefill, "enforce")
    start = pool_pages(prefill)
    print(json.dumps({"listening": prefill.kvguard_pd_channel.port}), flush=True)
    pending = [p for p, _ in workload(7, n)]
    while not (os.path.exists(os.path.join(wire, "stop")) and pd_rig.idle(prefill)):
        for req in pending[:4]:
            prefill.published.restore()
            prefill.handle_generate_request(req)
        del pending[:4]
        pd_rig.prefill_step(prefill)
    channel = prefill.kvguard_pd_channel
    print(json.dumps({
        "violations": [str(v) for v in prefill.kvguard.violations],
        "pages": [start, pool_pages(prefill)],
        "channel": dict(channel.metrics),
        "offers_left": len(channel._offers) + len(channel._deferred),
    }), flush=True)
    channel.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
