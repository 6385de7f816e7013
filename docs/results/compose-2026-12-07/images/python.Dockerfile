# A local stand-in for python:3.11-slim-bookworm (Docker Hub is not reachable here): Debian bookworm minbase with
# python3 and pip, PEP 668's marker removed as in the official image, this machine's CPU torch wheel, and this
# machine's CA bundle (its package-index proxy signs with its own CA).
FROM bookworm-minbase:local
RUN rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
COPY torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl /opt/wheels/
COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt
COPY pip.conf /etc/pip.conf
CMD ["python3"]
