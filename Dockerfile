# idemq: one static binary, run as a non-root user.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/idemq ./cmd/idemq

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idemq /usr/local/bin/idemq
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/idemq"]
CMD ["help"]
