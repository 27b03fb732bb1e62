package kvsched

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"

	conductorv1 "kvsched/clients/go/gen/kvsched/conductor/v1"
)

// MaxReconnectBackoff is the longest wait between connection attempts to one Conductor: a
// channel that failed to connect fails every call at once until its next attempt, so a
// standby that was down a while and now leads must not wait a long backoff out (Conductors
// are few: a few connection attempts a second cost nothing).
const MaxReconnectBackoff = 250 * time.Millisecond

// NormalizeAddress is host:port from an address that may carry a scheme (grpc://,
// grpcs://, http://, https://) or a trailing slash.
func NormalizeAddress(address string) string {
	address = strings.TrimRight(strings.TrimSpace(address), "/")
	for _, scheme := range []string{"grpc://", "grpcs://", "http://", "https://"} {
		if strings.HasPrefix(address, scheme) {
			return address[len(scheme):]
		}
	}
	return address
}

// TLSCredentials are credentials for Conductors serving (mutual) TLS: the CA their
// certificates chain to (caFile), and this client's certificate and key (its identity: an
// operator's admin one for SetPolicy; `kvsched up` writes their paths to the endpoints
// file's "admin" entry). certFile and keyFile go together; both empty: no client
// certificate (a Conductor that demands one refuses the connection).
func TLSCredentials(caFile, certFile, keyFile string) (credentials.TransportCredentials, error) {
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("kvsched: the TLS certificate and key go together")
	}
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("kvsched: reading the TLS CA: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("kvsched: no PEM certificate in %s", caFile)
	}
	config := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("kvsched: loading the TLS certificate and key: %w", err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return credentials.NewTLS(config), nil
}

// channels holds one connection per Conductor address, dialled on first use with the
// client's credentials and dial options (grpc.Dial does not block: it connects in the
// background and reconnects on its own).
type channels struct {
	dial []grpc.DialOption

	mu     sync.Mutex
	open   map[string]*grpc.ClientConn
	closed bool
}

func newChannels(creds credentials.TransportCredentials, extra []grpc.DialOption) *channels {
	transport := grpc.WithInsecure()
	if creds != nil {
		transport = grpc.WithTransportCredentials(creds)
	}
	dial := []grpc.DialOption{
		transport,
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  100 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   MaxReconnectBackoff,
			},
			MinConnectTimeout: 5 * time.Second,
		}),
	}
	return &channels{dial: append(dial, extra...), open: map[string]*grpc.ClientConn{}}
}

// stub is a ConductorService stub on the connection to address (dialled now if it is not
// open); ErrClosed once close ran.
func (c *channels) stub(address string) (conductorv1.ConductorServiceClient, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, closedError()
	}
	conn, ok := c.open[address]
	if !ok {
		var err error
		conn, err = grpc.Dial(address, c.dial...)
		if err != nil { // only a malformed option or address gets here
			return nil, newError(codes.InvalidArgument, fmt.Sprintf("dialling %s: %v", address, err), nil)
		}
		c.open[address] = conn
	}
	return conductorv1.NewConductorServiceClient(conn), nil
}

func (c *channels) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// close closes every connection (calls on them end CANCELLED) and refuses new ones.
func (c *channels) close() error {
	c.mu.Lock()
	open := c.open
	c.open, c.closed = map[string]*grpc.ClientConn{}, true
	c.mu.Unlock()
	var first error
	for _, conn := range open {
		if err := conn.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
