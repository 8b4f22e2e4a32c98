"""SGLang's module paths for the frontend (``sglang.lang.*``): ``sglite.lang.ir`` holds the
``REGEX_*`` constants programs import (``from sglang.lang.ir import REGEX_INT``)."""
