"""``python -m kt_ops info | demo | convert``: the ``kt-ops`` command line without its script.

``python -m kt_ops info`` prints what ``python -m kt_ops.info`` prints, without the
RuntimeWarning that runpy gives for the latter (``kt_ops.info`` is a submodule that the
package imports at start-up, for its ``info()`` function).
"""

import sys

from kt_ops.cli import main

sys.exit(main())
