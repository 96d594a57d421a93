#!/usr/bin/python
# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: retrieval_seed
short_description: Seed an exported OpenVINO Model Server repository into the serving directory
description:
  - Copies one device's exported model repository (the tree C(export_model.py) writes, with
    the server's C(config.json) at the top and, per model, the IR, C(openvino_tokenizer.xml)
    and a C(graph.pbtxt)) from O(src) into O(dest), the directory the server serves, so that
    O(dest) can neither go stale nor be marked current half-copied.
  - A marker file in O(dest) (O(marker)) says that O(dest) is current. It holds O(revision)
    and the size and sha256 of every file. It is removed before the first file of a seed
    changes and written last, after every file is flushed. An interrupted seed leaves no marker
    and a journal (C(<marker>.partial)); the next run verifies every file and completes the
    seed.
  - Every run reads both trees in full and compares each file's size and sha256. Nothing
    changes when O(dest) is current, that is when the marker holds O(revision) and O(src)'s
    file list, and O(dest) holds exactly O(src)'s files. Otherwise missing and different files
    are copied (a tampered file is replaced under a current marker too), what O(src) does not
    hold is removed, and the marker is written at O(revision). Files that are already identical
    are kept when O(revision) changes.
  - Files are copied one at a time, in O(chunk_size) pieces through one buffer, to a temporary
    name in their directory; every O(flush_bytes) and at the end of each file the data is
    synced and dropped from the page cache (C(POSIX_FADV_DONTNEED)) on both sides, then the
    file is renamed into place and its directory synced. So the dirty pages never exceed
    RV(dirty_bytes_bound), the unflushed part of one file.
  - With O(memory_bound=auto) the copy runs in a transient systemd scope bounded by
    C(MemoryMax=)RV(memory_bound_bytes), computed from the largest file and the flush interval.
  - The top-level C(config.json) is copied after every other file, so a server that polls its
    config sees the new one only when the files it names are in place.
  - The module opens no device; seeding holds no GPU.
version_added: 0.1.0
author:
  - cardshare.gpuhost contributors (@cardshare)
options:
  src:
    description:
      - The exported repository for one target device, a directory on the host (for example
        the C(gpu/) or the C(cpu/) tree of an export). It must hold the server's C(config.json)
        at its top.
      - Regular files and directories only; any symbolic link, FIFO, socket or device in it is
        refused. O(src) itself may be a link to the tree.
    type: path
    required: true
  dest:
    description:
      - The serving directory (the server's model volume), made when missing. It belongs to the
        seed, which removes from it what O(src) does not hold.
      - A O(dest) without marker or journal that holds anything O(src) does not is refused
        rather than emptied. O(dest) must not be O(src), inside it or around it.
    type: path
    required: true
  revision:
    description:
      - The revision the repository was exported at (the model image tag, the export's
        commit); the marker holds it. A change of revision re-seeds.
      - A non-empty single line without surrounding blanks, at most 200 characters.
    type: str
    required: true
  marker:
    description:
      - Name of the marker file in O(dest). The journal is this name with C(.partial) appended.
        Neither may be a name at the top of O(src).
    type: str
    default: .cardshare-seed
  chunk_size:
    description:
      - Bytes read and written at a time; the process holds one such buffer.
      - From 65536 to 268435456.
    type: int
    default: 4194304
  flush_bytes:
    description:
      - Within a file, sync the data written and drop it from the page cache every this many
        bytes, so the dirty set stays below O(flush_bytes) + O(chunk_size) whatever the size of
        the models.
      - V(0) syncs at the end of each file only; the dirty set is then one whole file, and
        RV(memory_bound_bytes) grows with the largest file. Otherwise at least O(chunk_size).
    type: int
    default: 67108864
  overrides:
    description:
      - Files of O(src) written with other content, a mapping of a file's path relative to O(src)
        (C(/)-separated) to its text, such as a rerank C(graph.pbtxt) with its batch guards
        injected. The marker holds the size and sha256 of the text, so a run with the same
        overrides changes nothing and a changed override rewrites that file alone.
      - An override of a path O(src) does not hold is refused.
    type: dict
    default: {}
  memory_bound:
    description:
      - V(auto) runs the copy under C(systemd-run --scope -p MemoryMax=)RV(memory_bound_bytes)
        when systemd runs the host (C(/run/systemd/system) exists) and C(systemd-run) is
        installed, and otherwise copies without the bound and says why in
        RV(memory_bound_detail).
      - V(required) fails, before anything changes, where the bound cannot be set.
      - V(off) copies in the module's own process, without a bound.
    type: str
    choices: [auto, required, 'off']
    default: auto
extends_documentation_fragment:
  - cardshare.gpuhost.attributes
attributes:
  check_mode:
    support: full
    details:
      - Reads and verifies both trees and reports what would change; writes nothing, not even
        O(dest).
  diff_mode:
    support: full
    details:
      - One line per file (path, size, sha256) of O(dest) before and after, headed by the
        revisions.
  idempotent:
    support: full
    details:
      - A second run with the same O(src) and O(revision) reports C(changed=false).
notes:
  - Every run reads every file of O(src) and O(dest) to compare sha256 (a few seconds per GB).
    That is what lets it repair a tampered or cut-short file under a current marker.
  - The server should not be serving O(dest) while it is re-seeded; the role stops it, seeds,
    and starts it on the new tree when the task reports C(changed).
  - Files are written C(0644) and directories C(0755), owned by the user the module runs as,
    so the server's user can read them. Empty directories of O(src) are not copied.
  - The memory bound is a cgroup bound on the copying process (C(MemoryMax=) of a transient
    scope). The dirty pages it has to hold are bounded by the flushes, not by the bound; the
    bound is what makes a wrong flush a failed task rather than a host under memory pressure.
seealso:
  - name: OpenVINO Model Server, exporting models
    description: The C(export_model.py) script that writes the repository layout.
    link: https://github.com/openvinotoolkit/model_server/tree/main/demos/common/export_models
"""

EXAMPLES = r"""
- name: Seed the card's model repository
  cardshare.gpuhost.retrieval_seed:
    src: /srv/cardshare/exports/2026.2.1-r3/gpu
    dest: /srv/cardshare/retrieval/models
    revision: 2026.2.1-r3
  register: __retrieval_seed

- name: Restart the server on a new tree
  ansible.builtin.debug:
    msg: "{{ __retrieval_seed.reasons | join('; ') }}"
  when: __retrieval_seed.changed

- name: Seed the CPU control arm, refusing to copy without the memory bound
  cardshare.gpuhost.retrieval_seed:
    src: /srv/cardshare/exports/2026.2.1-r3/cpu
    dest: /srv/cardshare/retrieval/models-cpu
    revision: 2026.2.1-r3
    memory_bound: required
"""

RETURN = r"""
src:
  description: O(src), resolved.
  returned: always
  type: str
  sample: /srv/cardshare/exports/2026.2.1-r3/gpu
dest:
  description: O(dest), resolved.
  returned: always
  type: str
  sample: /srv/cardshare/retrieval/models
revision:
  description: O(revision), which the marker holds after the run (in check mode, would hold).
  returned: always
  type: str
  sample: 2026.2.1-r3
previous_revision:
  description: The revision a readable marker held before the run; null when there was none.
  returned: always
  type: str
  sample: 2026.2.1-r2
interrupted_revision:
  description: >-
    The revision an interrupted seed was writing (from the journal it left); null when no seed
    was interrupted.
  returned: always
  type: str
marker:
  description: Path of the marker file.
  returned: always
  type: str
  sample: /srv/cardshare/retrieval/models/.cardshare-seed
plan:
  description: What the run changed (in check mode, would change), as paths relative to O(dest).
  returned: always
  type: dict
  contains:
    add:
      description: Files of O(src) missing from O(dest).
      type: list
      elements: str
      sample: [bge-m3/openvino_model.bin]
    replace:
      description: Files of O(dest) whose size or sha256 differs from O(src)'s.
      type: list
      elements: str
    remove:
      description: >-
        Entries of O(dest) that O(src) does not hold, deepest first; directories end with
        C(/).
      type: list
      elements: str
      sample: [bge-m3-old/graph.pbtxt, bge-m3-old/]
reasons:
  description: Why O(dest) was not current; empty when it was.
  returned: always
  type: list
  elements: str
  sample: ["the marker is at revision '2026.2.1-r2', '2026.2.1-r3' is asked for"]
files_total:
  description: Number of files in O(src).
  returned: always
  type: int
bytes_total:
  description: Their total size in bytes.
  returned: always
  type: int
files_copied:
  description: Files copied by this run (0 in check mode).
  returned: always
  type: int
bytes_copied:
  description: Bytes copied by this run (0 in check mode).
  returned: always
  type: int
files_removed:
  description: Entries removed from O(dest) by this run (0 in check mode).
  returned: always
  type: int
largest_file:
  description: Path of the largest file of O(src), relative to it.
  returned: always
  type: str
  sample: bge-reranker-v2-m3/openvino_model.bin
largest_file_bytes:
  description: Its size in bytes.
  returned: always
  type: int
  sample: 568700000
dirty_bytes_bound:
  description: >-
    The most dirty bytes the copy lets pile up: the smaller of RV(largest_file_bytes) and
    O(flush_bytes) + O(chunk_size) (RV(largest_file_bytes) when O(flush_bytes=0)).
  returned: always
  type: int
  sample: 71303168
memory_bound_bytes:
  description: >-
    The memory bound for the copy: 64 MiB for the interpreter, one O(chunk_size) buffer and
    twice RV(dirty_bytes_bound) (the destination's dirty range and the source's cached range),
    rounded up to a MiB.
  returned: always
  type: int
  sample: 213909504
memory_bound_enforced:
  description: Whether the copy ran in a systemd scope bounded by RV(memory_bound_bytes).
  returned: always
  type: bool
memory_bound_detail:
  description: How the bound was set, or why it was not.
  returned: always
  type: str
  sample: >-
    systemd does not run this host (no /run/systemd/system): the seed ran without a memory
    bound
"""

import sys  # noqa: E402
from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # type: ignore[import-untyped]  # noqa: E402
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_bound import (  # noqa: E402
    MEMORY_BOUND_CHOICES,
    bound_method,
    child_argv,
    child_program,
    largest_source_file,
    parse_child_output,
    scope_argv,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_copy import seed  # noqa: E402
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_options import (  # noqa: E402
    DEFAULT_CHUNK_SIZE,
    DEFAULT_FLUSH_BYTES,
    DEFAULT_MARKER,
    SeedError,
    validate_options,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_plan import (  # noqa: E402
    memory_bound_bytes,
)

ARGUMENT_SPEC: dict[str, Any] = {
    "src": {"type": "path", "required": True},
    "dest": {"type": "path", "required": True},
    "revision": {"type": "str", "required": True},
    "marker": {"type": "str", "default": DEFAULT_MARKER},
    "chunk_size": {"type": "int", "default": DEFAULT_CHUNK_SIZE},
    "flush_bytes": {"type": "int", "default": DEFAULT_FLUSH_BYTES},
    "memory_bound": {"type": "str", "default": "auto", "choices": list(MEMORY_BOUND_CHOICES)},
    "overrides": {"type": "dict", "default": {}},
}


def run_module(module: AnsibleModule) -> dict[str, Any]:
    """Seed in this process or in a bounded child; raises SeedError with the user's message."""
    options = validate_options(module.params)
    diff = bool(module._diff)
    if module.check_mode:
        result = seed(options, check_mode=True, diff=diff)
        result.update(
            memory_bound_enforced=False,
            memory_bound_detail="check mode: nothing was copied, so nothing was bounded",
        )
        return result

    setting = module.params["memory_bound"]
    systemd_run = module.get_bin_path("systemd-run")
    use_scope, detail = bound_method(setting, systemd_run)
    program = child_program() if use_scope else None
    if use_scope and program is None:
        if setting == "required":
            raise SeedError(
                "memory_bound: required, but the module cannot read its seed code to run it "
                "under systemd-run; give memory_bound=auto to seed without the bound"
            )
        use_scope = False
        detail = "the seed code could not be read for systemd-run: it ran without a memory bound"
    if not use_scope:
        result = seed(options, diff=diff)
        result.update(memory_bound_enforced=False, memory_bound_detail=detail)
        return result

    bound = memory_bound_bytes(
        largest_source_file(options.src), options.chunk_size, options.flush_bytes
    )
    argv = scope_argv(systemd_run, bound, options.dest) + child_argv(sys.executable, options, diff)
    rc, out, err = module.run_command(argv, data=program)
    result = parse_child_output(rc, out, err, bound)
    result.update(
        memory_bound_enforced=True,
        memory_bound_detail=f"the copy ran in a transient systemd scope with MemoryMax={bound}",
    )
    return result


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        result = run_module(module)
    except SeedError as exc:
        module.fail_json(msg=str(exc))
    for warning in result.pop("warnings", []):
        module.warn(warning)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
