#!/bin/sh
# `pip install ARGS...` inside an image build, with the build's optional inputs when they were given:
#   /run/secrets/pip-ca  a CA bundle pip must trust (a TLS-intercepting proxy in front of the package
#                        index): `--secret id=pip-ca,src=FILE`; a secret is never stored in a layer
#   /wheels              a folder of wheels pip looks in first (its find-links), e.g. a CPU build of
#                        torch: `podman build -v DIR:/wheels:ro`; a build-time volume is not stored either
# Without them this is plain `pip install` against the package index, as in any public build.
set -eu
if [ -s /run/secrets/pip-ca ]; then
  export PIP_CERT=/run/secrets/pip-ca
fi
if [ -d /wheels ] && [ -n "$(ls -A /wheels)" ]; then
  export PIP_FIND_LINKS=/wheels
fi
exec python -m pip install --no-cache-dir --disable-pip-version-check "$@"
