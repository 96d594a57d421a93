# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The modules' ``attributes:`` documentation, written once.

``cardshare.gpuhost.attributes`` says what each attribute means; a second fragment says how
much a kind of module supports it.  A module extends both, as in community.general and
community.docker::

    extends_documentation_fragment:
      - cardshare.gpuhost.attributes
      - cardshare.gpuhost.attributes.info_module

Ansible merges the fragments attribute by attribute, so ``check_mode`` gets its
``description`` from the first and its ``support`` and ``details`` from the second.
"""

from __future__ import annotations


class ModuleDocFragment:
    # What each attribute means, whatever the module.
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: >-
      Can run in C(check_mode) and return changed status prediction without modifying
      target.
  diff_mode:
    description: >-
      Will return details on what has changed (or possibly needs changing in C(check_mode)),
      when in diff mode.
  idempotent:
    description:
      - When run twice in a row outside check mode, with the same arguments, the second
        invocation indicates no change.
      - This assumes that the system controlled/queried by the module has not changed in a
        relevant way.
"""

    # A module that only reads the host (the *_info modules). Use with the standard fragment.
    INFO_MODULE = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - The module only reads; check mode reports the same as a normal run.
  diff_mode:
    support: none
    details:
      - Nothing changes, so there is no diff.
  idempotent:
    support: full
    details:
      - Reading twice reports C(changed=false) both times.
"""
