#!/bin/sh
# The image the Dockerfiles build FROM (build arg PYTHON_IMAGE). Prints its name.
#   docker/base-image.sh            # podman; CONTAINER_ENGINE=docker for Docker
#   docker build --build-arg PYTHON_IMAGE="$(docker/base-image.sh)" ...
# It is the Dockerfiles' default (python:3.11 slim, bookworm) when that is present or can be pulled.
# Only where no registry answers (a sandbox, an air-gapped builder) it makes one: Debian bookworm with
# its Python 3.11, bootstrapped by mmdebstrap (root, or fakechroot/unshare) and imported into the engine.
# The apt sources inside are DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR, which the images' apt-get uses.
set -eu

ENGINE=${CONTAINER_ENGINE:-podman}
HERE=$(dirname "$0")
DEFAULT_IMAGE=$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$HERE/worker.Dockerfile")
PYTHON_IMAGE=${PYTHON_IMAGE:-$DEFAULT_IMAGE}
LOCAL_IMAGE=${LOCAL_IMAGE:-localhost/kvgrid-python:3.11-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
PULL_TIMEOUT=${PULL_TIMEOUT:-60}

log() { echo "base-image: $*" >&2; }

for image in "$PYTHON_IMAGE" "$LOCAL_IMAGE"; do
	if "$ENGINE" image inspect "$image" >/dev/null 2>&1; then
		echo "$image"
		exit 0
	fi
done
if timeout "$PULL_TIMEOUT" "$ENGINE" pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
	echo "$PYTHON_IMAGE"
	exit 0
fi

log "cannot pull $PYTHON_IMAGE; making $LOCAL_IMAGE with mmdebstrap from $DEBIAN_MIRROR"
command -v mmdebstrap >/dev/null || { log "mmdebstrap is not installed (apt-get install mmdebstrap)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# python-is-python3: the Dockerfiles run `python`. As in the slim images: no docs, man pages or
# translations (dpkg keeps skipping them in the images), no apt lists or caches.
mmdebstrap --variant=minbase --quiet \
	--include=python3,python3-venv,python-is-python3,ca-certificates,netbase,passwd \
	--aptopt='APT::Install-Recommends "false"' \
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
	--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' \
	--customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb' \
	bookworm "$work/rootfs.tar" \
	"deb $DEBIAN_MIRROR bookworm main" \
	"deb $DEBIAN_MIRROR bookworm-updates main" \
	"deb $DEBIAN_SECURITY_MIRROR bookworm-security main" >&2
"$ENGINE" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
	--message "Debian bookworm with python3.11, by docker/base-image.sh" \
	"$work/rootfs.tar" "$LOCAL_IMAGE" >/dev/null
echo "$LOCAL_IMAGE"
