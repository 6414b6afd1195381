#!/bin/sh
# `make deps`: installs those of the Debian packages named as arguments
# that are not installed yet, without their Recommends, and leaves no
# system service enabled or running because of it.
#
#   build-aux/deps.sh PACKAGE...        (as root when anything is missing)
#
# Why the service handling: a Debian package's maintainer scripts start its
# service at install (invoke-rc.d, deb-systemd-invoke) and enable it for
# every later boot (deb-systemd-helper enable, update-rc.d defaults). The
# project wants only promtool out of `prometheus`, not a Prometheus server
# running on the developer's machine. So for the length of the install a
# /usr/sbin/policy-rc.d answers 101 ("action forbidden"), which both
# starters obey; one already there belongs to the administrator and is left
# alone. Afterwards every unit and init script of a package that this run
# installed is disabled; a package that was installed before keeps its
# state. Where systemd is not running (a container, a chroot) the same
# steps apply: both helpers work on the files alone.
set -eu

missing=
for package in "$@"; do
	dpkg-query -W -f='${db:Status-Status}\n' "$package" 2>/dev/null | grep -qx installed ||
		missing="$missing $package"
done
[ -n "$missing" ] || exit 0
if [ "$(id -u)" -ne 0 ]; then
	echo "deps: not installed:$missing; run \`make deps\` as root to install them" >&2
	exit 1
fi
echo "deps: installing$missing"

installed() {
	dpkg-query -W -f='${db:Status-Status} ${Package}\n' | awk '$1 == "installed" { print $2 }' | sort
}

policy=/usr/sbin/policy-rc.d
own_policy=
before=$(mktemp)
trap 'rm -f "$before"; if [ -n "$own_policy" ]; then rm -f "$policy"; fi' EXIT
trap 'exit 130' INT TERM
if [ ! -e "$policy" ]; then
	own_policy=yes
	printf '#!/bin/sh\n# make deps (zipcached): no service starts during this install.\nexit 101\n' >"$policy"
	chmod 755 "$policy"
fi
installed >"$before"

apt-get update -qq
# $missing is a list of package names: split on purpose.
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing

systemd_running=
if [ -d /run/systemd/system ]; then
	systemd_running=yes
fi
installed | comm -13 "$before" - | while read -r package; do
	dpkg-query -L "$package" | while read -r path; do
		case $path in
		(/lib/systemd/system/*@.*|/usr/lib/systemd/system/*@.*)
			;;   # templates: enabled only through an instance, never here
		(/lib/systemd/system/*.service|/lib/systemd/system/*.socket|\
		 /lib/systemd/system/*.timer|/lib/systemd/system/*.path|\
		 /usr/lib/systemd/system/*.service|/usr/lib/systemd/system/*.socket|\
		 /usr/lib/systemd/system/*.timer|/usr/lib/systemd/system/*.path)
			unit=${path##*/}
			if [ -n "$systemd_running" ] && systemctl --quiet is-active "$unit"; then
				systemctl stop "$unit"
				echo "deps: stopped $unit ($package)"
			fi
			# The helper that enabled it, as the package's own scripts
			# call it (it insists on knowing the package), so that its
			# state says "disabled" and an upgrade keeps it so.
			if DPKG_MAINTSCRIPT_PACKAGE=$package deb-systemd-helper --quiet is-enabled "$unit"; then
				DPKG_MAINTSCRIPT_PACKAGE=$package deb-systemd-helper disable "$unit"
				echo "deps: disabled $unit of $package (\`systemctl enable --now $unit\` to use it)"
			fi
			;;
		(/etc/init.d/*)
			script=${path##*/}
			# update-rc.d disables the systemd unit of the same name too.
			if ls /etc/rc[2-5].d/S[0-9][0-9]"$script" >/dev/null 2>&1; then
				update-rc.d "$script" disable >/dev/null
				echo "deps: disabled service $script of $package (\`update-rc.d $script enable\` to use it)"
			fi
			;;
		esac
	done
done
